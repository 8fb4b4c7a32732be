"""One titan-run job from a benchmark: run it, read its per-step times back.

Shared by the benchmarks that time ``titan-run`` itself (bench_compile, bench_bounds,
bench_vs_torchtitan), so each reads ``metrics.jsonl`` the same way.
"""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path


def threads_per_rank(ranks: int) -> int:
    """Intra-op threads for each of ``ranks`` local ranks: cores // ranks, at least 1."""
    return max(1, (os.cpu_count() or 1) // ranks)


def step_times(overrides: list[str], run_dir: Path, *, ranks: int, timeout: float = 1800,
               env: dict[str, str] | None = None) -> list[float]:
    """Run ``titan-run overrides`` into ``run_dir`` with ``OMP_NUM_THREADS`` set per
    rank and return every step's ``step_time_s`` in step order. Raises with the
    run's one-line error if it fails."""
    from titan_plugins.train.api import run

    result = run(overrides, run_dir=run_dir, timeout=timeout,
                 env={"OMP_NUM_THREADS": str(threads_per_rank(ranks)), **(env or {})})
    if result.returncode:
        raise RuntimeError(f"titan-run {' '.join(overrides)} failed: {result.error}")
    times: dict[int, float] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if "step_time_s" in rec:
            times[int(rec["step"])] = float(rec["step_time_s"])
    return [times[s] for s in sorted(times)]


def steady_step_s(times: list[float], warmup: int) -> float:
    """The median step time after ``warmup`` steps (the last step if none are left)."""
    return statistics.median(times[warmup:] or times[-1:])
