"""``titan-run ... plan=true``: check a parallelism plan at full scale in one process.

For each chosen rank: the fake process group at the full world size, the meshes,
the model built on the meta device, the runtime's pipeline split for that rank's
stages and the plugin's real parallelize hook. Nothing is allocated and no rank
is spawned; the report reads shard shapes and FSDP state off the modules.

    titan-run model=deepseek_v3 model.flavor=671B parallelism=fsdp16_tp8_ep64_pp16 plan=true
    titan-run model=qwen3 parallelism.dp_shard=-1 parallelism.tp=4 plan=true parallelism.world_size=512 --json

``run_plan(spec, job, pm)`` prints the report (JSON with ``plan.json``) and returns
0 when the peak per-rank memory fits ``plan.device_memory_gb``, 1 when it does
not. Configuration errors raise ``ConfigError`` with the one-line message a real
launch gives (the runtime's ``validate_job`` runs first).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from titan_plugins.plugins import TitanPluginManager
    from titan_plugins.spec import ModelSpec

__all__ = ["Plan", "RankPlan", "make_plan", "run_plan"]


def __getattr__(name: str) -> Any:
    if name in ("Plan", "RankPlan", "make_plan"):
        from titan_plugins.plan import planner

        return getattr(planner, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def run_plan(spec: ModelSpec, job: DictConfig, pm: TitanPluginManager) -> int:
    """Plan ``job`` for ``spec``, print the report, return the exit code."""
    from titan_plugins.plan.planner import make_plan
    from titan_plugins.plan.report import render_json, render_text

    plan = make_plan(spec, job, pm)
    print(render_json(plan) if bool(job.plan.json) else render_text(plan), flush=True)
    return 0 if plan.fits else 1
