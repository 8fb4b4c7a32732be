"""Failure records: the one place that knows how a rank reports its failure and how
the launcher reads it back.

A rank writes its failure (``record_failure``) atomically to torch elastic's
per-rank error file (``TORCHELASTIC_ERROR_FILE``) and to the launcher's folder
(``$TITAN_FAILURE_DIR/rank-N.json``): a user error (``TitanError``) as its first
line, a crash with its traceback, a Ctrl-C as ``interrupted``. The launcher picks
the earliest failure (``first_failure``) and writes its line to the run directory's
``error.txt`` (``write_error_file``), which ``read_error_file`` reads back.

A rank killed by a signal (the OOM killer's SIGKILL, a preemption's SIGTERM) writes
nothing: it is the job's first failure whenever torch saw it die of a signal without
a record, since its peers' records ("Connection closed by peer") are its fallout.
"""

from __future__ import annotations

import json
import os
import time
import traceback
from pathlib import Path
from typing import Any

__all__ = [
    "ERROR_FILE",
    "FAILURE_DIR_ENV",
    "INTERRUPTED",
    "clear_error_file",
    "failure_line",
    "first_failure",
    "read_error_file",
    "read_failure_records",
    "record_failure",
    "write_error_file",
]

FAILURE_DIR_ENV = "TITAN_FAILURE_DIR"
ERROR_FILE = "error.txt"
INTERRUPTED = "interrupted (Ctrl-C)"
_RECORDED = "_titan_recorded"


# ------------------------------------------------------------------ ranks write
def record_failure(exc: BaseException) -> None:
    """Write ``exc`` once, atomically, to torch elastic's per-rank error file and to
    the launcher's folder of records. A clean ``SystemExit`` is not a failure."""
    from titan_plugins.errors import TitanError

    if getattr(exc, _RECORDED, False) or (isinstance(exc, SystemExit) and not exc.code):
        return
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    folder = os.environ.get(FAILURE_DIR_ENV)
    rank = os.environ.get("RANK", "0")
    targets = [t for t in (path, folder and os.path.join(folder, f"rank-{rank}.json")) if t]
    if not targets:
        return
    user = isinstance(exc, TitanError)
    first = (str(exc).strip().splitlines() or [""])[0]
    callstack = "".join(traceback.format_exception(exc))
    if isinstance(exc, KeyboardInterrupt):
        message, user = INTERRUPTED, True
    elif user:
        message = first or type(exc).__name__
    else:
        message = f"rank {rank} crashed: {type(exc).__name__}: {first}\n{callstack.rstrip()}"
    data = {
        "message": {
            "message": message,
            "extraInfo": {
                "py_callstack": callstack,
                "timestamp": str(int(time.time())),
                "titan_time_ns": time.time_ns(),
                "titan_user_error": user,
            },
        }
    }
    for target in targets:
        # Atomic: the agent may kill this rank at any moment, then reads the file.
        with open(f"{target}.tmp", "w") as f:
            json.dump(data, f)
        os.replace(f"{target}.tmp", target)
    try:
        setattr(exc, _RECORDED, True)
    except AttributeError:  # an exception type with __slots__: recorded again, same content
        pass


# ---------------------------------------------------------- the launcher reads
def read_failure_records(folder: str | os.PathLike) -> dict[int, dict]:
    """The ``rank-N.json`` failure records the ranks wrote (``TITAN_FAILURE_DIR``)."""
    records = {}
    for path in Path(folder).glob("rank-*.json"):
        try:
            records[int(path.stem.split("-", 1)[1])] = json.loads(path.read_text())
        except (ValueError, OSError):
            continue  # a rank killed mid-write leaves no complete record (writes are atomic)
    return records


def _info(data: dict) -> dict:
    msg = data.get("message")
    return msg.get("extraInfo", {}) if isinstance(msg, dict) else {}


def first_failure(exc: Any, records: dict[int, dict] | None = None) -> tuple[int, str, bool, int]:
    """(rank, message, is_user_error, exitcode) of the job's first failure.

    ``exc`` is torch's ``ChildFailedError``. Candidates are the ranks that recorded a
    failure (``records``), including ranks the agent stopped before they exited
    (torch's ``exc.failures`` lists only the processes that had exited by then), and
    every failed process torch reports. A process killed by a signal without a
    record comes first (its peers' records are its fallout), then the earliest record.
    """
    records = dict(records or {})
    candidates = [(rank, records.pop(rank, None) or failure.error_file_data or {}, failure)
                  for rank, failure in exc.failures.items()]
    candidates += [(rank, data, None) for rank, data in records.items()]

    def order(candidate):
        rank, data, failure = candidate
        t_ns = _info(data).get("titan_time_ns")
        if failure is not None and failure.exitcode < 0 and t_ns is None:  # killed, no record
            return (0, failure.timestamp, rank)
        if t_ns is not None:
            return (1, t_ns, rank)
        return (2, failure.timestamp * 10**9 if failure is not None else 0, rank)

    rank, data, failure = min(candidates, key=order)
    info = _info(data)
    user = bool(info.get("titan_user_error"))
    msg = data.get("message")
    text = msg.get("message", "") if isinstance(msg, dict) else (msg or "")
    code = failure.exitcode if failure is not None and failure.exitcode > 0 else (2 if user else 1)
    if text == INTERRUPTED:
        code = 130
    if not text or text == "<NONE>" or text.startswith("To enable traceback"):  # torch wrote no record
        text = f"rank {rank} exited with code {code}"
        if failure is not None and failure.exitcode < 0:
            text = f"rank {rank} was killed by signal {failure.signal_name()}"
            code = 128 - failure.exitcode
    return rank, text, user, code


def failure_line(text: str) -> str:
    """How the launcher prints the job's first failure: ``error: <text>`` for every
    kind (a user error, a crash with its traceback below, a rank killed by a signal,
    an exit code), like every other failure line of the CLIs."""
    return f"error: {text}"


# ------------------------------------------------------- the run's error.txt
def write_error_file(run_dir: str | os.PathLike, text: str) -> None:
    """The job's error line (and a crash's traceback) in ``<run_dir>/error.txt``."""
    try:
        Path(run_dir, ERROR_FILE).write_text(text.rstrip("\n") + "\n")
    except OSError:  # a full or read-only disk must not add a second traceback
        pass


def read_error_file(run_dir: str | os.PathLike) -> str | None:
    path = Path(run_dir, ERROR_FILE)
    return path.read_text().strip() if path.is_file() else None


def clear_error_file(run_dir: str | os.PathLike) -> None:
    Path(run_dir, ERROR_FILE).unlink(missing_ok=True)
