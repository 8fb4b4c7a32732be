"""Per-job result files and the multirun summary table.

Every run writes ``<run dir>/result.json`` (titan-run, ``train.api.run``, rank 0 under
``srun``/torchrun), with which launcher and Slurm job/step it ran under; after a sweep
the table is built from those files in the sweep directory, so it works with any Hydra
launcher (basic, joblib, submitit) as long as the sweep directory is shared.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback

from titan_plugins.train.run_files import write_result

__all__ = ["SummaryCallback", "format_table", "read_results", "write_result"]

FAILED_JOBS: list[str] = []  # filled by SummaryCallback in the launching process
SWEEP: dict[str, Any] = {}  # the running sweep's directory, and whether its summary was printed
NO_RESULT = "no result.json: the job ended before writing one (killed, timed out or cancelled?)"


def read_results(sweep_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """One record per job directory (``<num>_...``): its ``result.json``, or a failure
    when it has none (a job Slurm killed before its task could write one)."""
    results = []
    for folder in Path(sweep_dir).iterdir() if Path(sweep_dir).is_dir() else ():
        if not folder.is_dir() or folder.name.startswith("."):
            continue
        path = folder / "result.json"
        try:
            results.append(json.loads(path.read_text()))
        except FileNotFoundError:
            job = folder.name.split("_", 1)[0]
            results.append({"job": job, "overrides": "", "status": "failed", "error": NO_RESULT})
        except (OSError, ValueError):
            results.append({"job": folder.name, "overrides": "", "status": "unreadable"})
    return sorted(results, key=lambda r: (len(str(r.get("job"))), str(r.get("job"))))


def format_table(results: list[dict[str, Any]]) -> str:
    header = ("job", "overrides", "final loss", "tokens/s", "status")
    rows = [header]
    split = [str(r.get("overrides", "")).split() for r in results]
    common = set.intersection(*(set(s) for s in split)) if len(split) > 1 else set()
    for r, ovr in zip(results, split):
        r = {**r, "overrides": " ".join(o for o in ovr if o not in common)}
        loss = r.get("final_loss")
        tps = r.get("tokens_per_s")
        status = r.get("status", "?")
        if status != "ok" and r.get("error"):
            status = f"failed: {str(r['error']).splitlines()[0][:80]}"
        rows.append((
            str(r.get("job", "")),
            str(r.get("overrides", "")),
            f"{loss:.4f}" if isinstance(loss, float) else "-",
            f"{tps:,.0f}" if isinstance(tps, float) else "-",
            status,
        ))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header) - 1)]
    lines = []
    for n, row in enumerate(rows):
        lines.append("  ".join(cell.ljust(w) for cell, w in zip(row, widths)) + "  " + row[-1])
        if n == 0:
            lines.append("  ".join("-" * w for w in widths) + "  " + "-" * len(row[-1]))
    return "\n".join(lines)


def print_summary(sweep_dir: str | os.PathLike) -> None:
    """The sweep's line (jobs, failed) and table, from the job directories' files."""
    results = read_results(sweep_dir)
    FAILED_JOBS[:] = [str(r.get("job")) for r in results if r.get("status") != "ok"]
    print(f"\nsweep {sweep_dir}: {len(results)} jobs, {len(FAILED_JOBS)} failed", flush=True)
    print(format_table(results), flush=True)
    SWEEP["printed"] = True


class SummaryCallback(Callback):
    """Prints the summary table once every job of a multirun has finished (and remembers
    the sweep directory, so that a launcher that gives up on a job, as submitit does on a
    job Slurm killed, still ends with the summary)."""

    def on_multirun_start(self, config: Any, **kwargs: Any) -> None:
        SWEEP.clear()
        SWEEP["dir"] = str(config.hydra.sweep.dir)

    def on_multirun_end(self, config: Any, **kwargs: Any) -> None:
        print_summary(config.hydra.sweep.dir)
