"""What a run leaves in its directory: the resolved ``config.yaml`` the ranks read,
``result.json`` (one record per run, the sweep table's row), and the losses read back
from ``metrics.jsonl`` (``RunResult``).

Its own module so that the programmatic launcher (``train.api``), the sweep summary
(``train.sweep``) and a rank started by another launcher (``distributed.external``,
through ``RANK_STEPS``) share one writer without importing one another.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from titan_plugins.distributed.external import RankSteps, launch_info

__all__ = ["RANK_STEPS", "RunResult", "read_result", "write_config", "write_result"]


@dataclass
class RunResult:
    """What a finished (or failed) run left in its directory."""

    returncode: int
    run_dir: Path
    losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    steps: list[int] = field(default_factory=list)
    tokens_per_s: float | None = None
    error: str | None = None
    stdout: str = ""
    stderr: str = ""

    @property
    def ok(self) -> bool:
        return self.returncode == 0


def write_config(job: DictConfig, run_dir: str | os.PathLike) -> Path:
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "config.yaml"
    tmp = path.with_name(f".config.yaml.{os.getpid()}.tmp")
    tmp.write_text(OmegaConf.to_yaml(job, resolve=True))
    os.replace(tmp, path)
    return path


def read_result(run_dir: str | os.PathLike, returncode: int = 0, error: str | None = None) -> RunResult:
    """Losses, grad norms and throughput from ``<run_dir>/metrics.jsonl`` (the last
    record of each step wins, so a resumed run reads as one run)."""
    run_dir = Path(run_dir)
    by_step: dict[int, dict] = {}
    path = run_dir / "metrics.jsonl"
    if path.is_file():
        for line in path.read_text().splitlines():
            if line.strip():
                rec = json.loads(line)
                if "step" in rec and "loss" in rec:
                    by_step[int(rec["step"])] = rec
    steps = sorted(by_step)
    tps = [by_step[s]["tokens_per_s"] for s in steps]
    steady = tps[1:] if len(tps) > 1 else tps
    if error is None and returncode != 0:
        from titan_plugins.failures import read_error_file

        error = read_error_file(run_dir)
    return RunResult(
        returncode=returncode,
        run_dir=run_dir,
        losses=[by_step[s]["loss"] for s in steps],
        grad_norms=[by_step[s]["grad_norm"] for s in steps],
        steps=steps,
        tokens_per_s=(sorted(steady)[len(steady) // 2] if steady else None),
        error=error,
    )


def write_result(run_dir: str | os.PathLike, *, job: str, overrides: str, returncode: int,
                 error: str | None = None) -> dict[str, Any]:
    res = read_result(run_dir, returncode, error)
    record = {
        "job": job,
        "overrides": overrides,
        "final_loss": res.losses[-1] if res.losses else None,
        "tokens_per_s": res.tokens_per_s,
        "status": "ok" if returncode == 0 else "failed",
        "returncode": returncode,
        "error": res.error,
        "steps": len(res.steps),
        "launch": launch_info(),  # titan-run / torchrun / slurm, and the Slurm job and step
    }
    path = Path(run_dir, "result.json")
    tmp = path.with_name(f".result.json.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(record) + "\n")
    os.replace(tmp, path)
    return record


def _run_rank(config_path: Path) -> None:
    from titan_plugins.train.worker import run_rank  # torch and the trainer: only when a rank runs

    run_rank(config_path)


# The trainer's side of a rank that another launcher started: distributed.external
# resolves this by name (distributed/ sits below train/ and never imports it).
RANK_STEPS = RankSteps(write_config=write_config, run_rank=_run_rank, write_result=write_result)
