"""Time and peak host memory of ``plan=true`` for DeepSeek-V3 671B at 2048 ranks.

    OMP_NUM_THREADS=1 python benchmarks/bench_plan.py [extra overrides...]

One process: Hydra composition, the launch's validation, then rank 0 and the first
rank of the last stage on the fake process group with the model on the meta device.
Prints JSON: ``seconds`` (composition + plan), ``plan_seconds`` (``make_plan``
alone), ``per_rank_seconds``, ``import_seconds`` and ``peak_rss_mib`` (the
process's maximum resident set, from ``getrusage``), with the plan's verdict.
"""

from __future__ import annotations

import json
import resource
import sys
import time

T0 = time.perf_counter()

OVERRIDES = [
    "model=deepseek_v3", "model.flavor=671B", "parallelism=fsdp16_tp8_ep64_pp16",
    "training.local_batch_size=16", "training.seq_len=4096", "precision=bf16_mixed",
    "training.activation_checkpoint=full", "plan=true", "plan.device_memory_gb=80",
]


def main(extra: list[str]) -> dict:
    import torch  # noqa: F401  (counted in import_seconds)

    from titan_plugins.config.hydra_glue import compose, resolve_job
    from titan_plugins.plan import make_plan
    from titan_plugins.plugins import get_plugin_manager
    from titan_plugins.train.api import typed_job

    imported = time.perf_counter()
    pm = get_plugin_manager(strict=True)
    spec, job = resolve_job(compose([*OVERRIDES, *extra], pm), pm)
    job = typed_job(job)
    start = time.perf_counter()
    plan = make_plan(spec, job, pm)
    end = time.perf_counter()
    peak = plan.peak
    return {
        "plan": f"{plan.model} {plan.flavor} world={plan.world_size} "
                + " ".join(f"{k}={v}" for k, v in plan.degrees.items()),
        "ranks": [r.rank for r in plan.ranks],
        "import_seconds": round(imported - T0, 2),
        "seconds": round(end - imported, 2),
        "plan_seconds": round(end - start, 2),
        "per_rank_seconds": {r.rank: round(r.seconds, 2) for r in plan.ranks},
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "planned_peak_gib_per_rank": round(peak.peak_bytes / 1024**3, 2),
        "fits": plan.fits,
    }


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1:]), indent=2))
