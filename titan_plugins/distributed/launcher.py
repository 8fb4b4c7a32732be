"""Start the local ranks of a job with torch's elastic launcher (torchrun's machinery).

``launch(config_path, nproc)`` runs ``titan_plugins.train.worker.entry`` in
``nproc`` spawned processes with a c10d rendezvous on localhost and no restarts.
When a rank fails the agent stops the others; the first failing rank's error is
printed once (one line for a user error, the traceback for a crash) and its exit
code returned. Multi-node jobs run under ``torchrun --nnodes`` instead (each
process then trains as its own rank; see ``titan_plugins.cli.run``).

``python -m titan_plugins.distributed.launcher CONFIG.yaml NPROC`` does the same
from a subprocess (``titan_plugins.train.api.run`` uses it to enforce timeouts).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import sys
import tempfile
import uuid
from pathlib import Path

from titan_plugins.distributed.parallel_dims import threads_per_rank

__all__ = ["FAILURE_DIR_ENV", "free_port", "launch", "read_failure_records"]

FAILURE_DIR_ENV = "TITAN_FAILURE_DIR"

_NOISY = ("torch.distributed.elastic", "torch.distributed.launcher", "torch.distributed.run", "torch.multiprocessing")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _quiet_elastic() -> None:
    for name in _NOISY:
        logging.getLogger(name).setLevel(logging.CRITICAL)


def _info(data: dict) -> dict:
    msg = data.get("message")
    return msg.get("extraInfo", {}) if isinstance(msg, dict) else {}


def read_failure_records(folder: str | os.PathLike) -> dict[int, dict]:
    """The ``rank-N.json`` failure records the ranks wrote (``TITAN_FAILURE_DIR``)."""
    records = {}
    for path in Path(folder).glob("rank-*.json"):
        try:
            records[int(path.stem.split("-", 1)[1])] = json.loads(path.read_text())
        except (ValueError, OSError):
            continue  # a rank killed mid-write leaves no complete record (writes are atomic)
    return records


def _first_failure(exc, records: dict[int, dict] | None = None) -> tuple[int, str, bool, int]:
    """(rank, message, is_user_error, exitcode) of the earliest recorded failure.

    Candidates are the ranks that recorded a failure (``records``), including ranks
    the agent stopped before they exited (torch's ``exc.failures`` lists only the
    processes that had exited by then), and every failed process torch reports.
    """
    records = dict(records or {})
    candidates = [(rank, records.pop(rank, None) or failure.error_file_data or {}, failure)
                  for rank, failure in exc.failures.items()]
    candidates += [(rank, data, None) for rank, data in records.items()]

    def order(candidate):
        rank, data, failure = candidate
        t_ns = _info(data).get("titan_time_ns")
        if t_ns is not None:
            return (0, t_ns, rank)
        return (1, failure.timestamp * 10**9 if failure is not None else 0, rank)

    rank, data, failure = min(candidates, key=order)
    info = _info(data)
    user = bool(info.get("titan_user_error"))
    msg = data.get("message")
    text = msg.get("message", "") if isinstance(msg, dict) else (msg or "")
    code = failure.exitcode if failure is not None and failure.exitcode > 0 else (2 if user else 1)
    if not text or text.startswith("To enable traceback"):
        text = f"rank {rank} exited with code {code}"
        if failure is not None and failure.exitcode < 0:
            text = f"rank {rank} was killed by signal {failure.signal_name()}"
    return rank, text, user, code


def launch(config_path: str | os.PathLike, nproc: int, *, error_file: str | os.PathLike | None = None) -> int:
    """Run ``nproc`` local ranks on the resolved config; returns the job's exit code."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from titan_plugins.train.worker import entry

    _quiet_elastic()
    os.environ.setdefault("OMP_NUM_THREADS", str(threads_per_rank(nproc)))
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=f"titan-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint=f"localhost:{free_port()}",
        rdzv_configs={"timeout": 120},
        max_restarts=0,
        monitor_interval=0.1,
        start_method="spawn",
    )
    # Every rank also writes its failure here: torch's ChildFailedError lists only
    # the processes that had exited when the agent noticed the first failure.
    failure_dir = tempfile.mkdtemp(prefix="titan-failures-")
    os.environ[FAILURE_DIR_ENV] = failure_dir
    try:
        elastic_launch(config, entry)(str(config_path))
    except ChildFailedError as exc:
        rank, text, user, code = _first_failure(exc, read_failure_records(failure_dir))
        line = f"error: {text}" if user else text
        print(line, file=sys.stderr, flush=True)
        if error_file is not None:
            Path(error_file).write_text(text + "\n")
        return code if code > 0 else 1
    finally:
        os.environ.pop(FAILURE_DIR_ENV, None)
        shutil.rmtree(failure_dir, ignore_errors=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    config_path, nproc = argv[0], int(argv[1])
    error_file = Path(config_path).parent / "error.txt"
    return launch(config_path, nproc, error_file=error_file)


if __name__ == "__main__":
    sys.exit(main())
