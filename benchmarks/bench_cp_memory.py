"""Context parallelism on this CPU: per-rank peak memory and speed at one long row (issue 48).

    python benchmarks/bench_cp_memory.py --seq 4096 --steps 2
    python benchmarks/bench_cp_memory.py --seq 4096 --layouts single cp2 fsdp2

Each layout runs ``titan-run`` (qwen3 debugmodel, fp32, one row of ``--seq`` tokens per
step: ``training.local_batch_size=1`` on every data-parallel rank) for ``--steps``
steps, and again at ``--short`` tokens. It reads rank 0's ``memory_gib`` (the peak
resident set of the process, ``getrusage``) and the last step's ``tokens_per_s`` from
``metrics.jsonl``. ``activation_mib`` is the peak at ``--seq`` minus the peak at
``--short``: what the long row adds (activations, gathered keys/values, the mask),
with the weights, optimizer state and torch's own footprint taken out. ``fsdp2``
trains two rows (one per rank) against ``cp2``'s one row cut in two. Prints one JSON
object per layout.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _titan_run import threads_per_rank  # noqa: E402

RANKS = {"single": 1, "cp2": 2, "fsdp2": 2, "cp4": 4, "fsdp2_cp2": 4}


def _run(layout: str, seq: int, steps: int, root: Path) -> dict[str, float]:
    from titan_plugins.train.api import run

    run_dir = root / f"{layout}-{seq}"
    overrides = [
        "model=qwen3", f"training.seq_len={seq}", "model.max_seq_len=" + str(max(seq, 4096)),
        "training.local_batch_size=1", f"training.steps={steps}", "training.warmup_steps=1",
        "metrics.tensorboard=false", "data=synthetic", "data.vocab_size=2048",
    ]
    overrides += ["parallelism.cp=4"] if layout == "cp4" else [f"parallelism={layout}"]
    result = run(overrides, run_dir=run_dir, timeout=3600,
                 env={"OMP_NUM_THREADS": str(threads_per_rank(RANKS[layout]))})
    if result.returncode:
        raise RuntimeError(f"{layout} at {seq}: {result.error}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in records if "memory_gib" in r][-1]
    return {"peak_mib": last["memory_gib"] * 1024, "tokens_per_s": last["tokens_per_s"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--short", type=int, default=256)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--layouts", nargs="+", default=["single", "cp2"], choices=sorted(RANKS))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-cp-") as tmp:
        for layout in args.layouts:
            long, short = _run(layout, args.seq, args.steps, Path(tmp)), _run(layout, args.short, args.steps, Path(tmp))
            print(json.dumps({
                "layout": layout, "ranks": RANKS[layout], "seq": args.seq,
                "peak_mib": round(long["peak_mib"]), "peak_short_mib": round(short["peak_mib"]),
                "activation_mib": round(long["peak_mib"] - short["peak_mib"]),
                "tokens_per_s": round(long["tokens_per_s"], 1),
            }), flush=True)


if __name__ == "__main__":
    main()
