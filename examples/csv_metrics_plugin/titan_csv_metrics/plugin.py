"""Writes every step's metrics to ``<run_dir>/metrics.csv`` on rank 0.

A non-model plugin: three lifecycle hooks, no config group, no torch. The columns
are ``step`` and the metrics of the first step (in the trainer's order); later
metrics that were not there at first are left out, missing ones left empty. A
resumed run appends to the file it finds.
"""

from __future__ import annotations

import csv
import os
from typing import Any

from titan_plugins import hookimpl

TITAN_PLUGINS_API = ">=1.0,<2"

FILENAME = "metrics.csv"

# Per process: where rank 0 writes, and the open file. Ranks are separate processes.
_state: dict[str, Any] = {}


@hookimpl
def titan_on_train_start(job_config: Any, run_dir: str, rank: int) -> None:
    if rank == 0:
        _close()
        _state["path"] = os.path.join(run_dir, FILENAME)


@hookimpl
def titan_on_step_end(step: int, metrics: dict[str, float], job_config: Any, rank: int) -> None:
    if rank != 0 or "path" not in _state:
        return
    if "writer" not in _state:
        path = _state["path"]
        header = _existing_header(path) or ["step", *metrics]
        handle = open(path, "a", newline="", encoding="utf-8")  # noqa: SIM115 (closed at train end)
        writer = csv.DictWriter(handle, fieldnames=header, extrasaction="ignore")
        if handle.tell() == 0:
            writer.writeheader()
        _state.update(handle=handle, writer=writer)
    _state["writer"].writerow({"step": step, **metrics})
    _state["handle"].flush()


@hookimpl
def titan_on_train_end(step: int, metrics: dict[str, float], job_config: Any, rank: int) -> None:
    if rank == 0:
        _close()


def _existing_header(path: str) -> list[str] | None:
    if not os.path.exists(path) or os.path.getsize(path) == 0:
        return None
    with open(path, newline="", encoding="utf-8") as handle:
        return next(csv.reader(handle), None)


def _close() -> None:
    handle = _state.pop("handle", None)
    _state.pop("writer", None)
    if handle is not None:
        handle.close()
