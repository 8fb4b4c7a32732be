"""Start the local ranks of a job with torch's elastic launcher (torchrun's machinery).

``launch(config_path, nproc, entry)`` runs ``entry(config_path)`` (the rank's
entry point, e.g. ``titan_plugins.train.worker.entry``) in ``nproc`` spawned
processes with a c10d rendezvous on localhost and no restarts. When a rank fails
the agent stops the others; the first failure (``titan_plugins.failures``: a rank
killed by a signal, else the earliest recorded error) is printed as one line (a
crash also with its traceback) and its exit code returned. Ctrl-C ends the job
with one line and exit code 130, whatever signal handlers the launcher inherited (the
ranks reset theirs: ``rank_signals``). ``forward``: signals (the preemption signal,
``checkpoint.on_signal``) passed on to the ranks alone; a job whose ranks saved and
stopped on one ends with their line and ``PREEMPTED_EXIT`` (75). On every exit path the
launcher ends every process the job left (``reaper``). Multi-node jobs run under ``torchrun --nnodes``
instead (each process then trains as its own rank; see ``titan_plugins.cli.run``).

``python -m titan_plugins.distributed.launcher CONFIG.yaml NPROC MODULE:FUNCTION``
does the same from a subprocess.
"""

from __future__ import annotations

import importlib
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path

from titan_plugins.distributed import fork_server
from titan_plugins.distributed.parallel_dims import threads_per_rank
from titan_plugins.distributed.rank_signals import (
    PENDING_FILE,
    PID_FILE,
    PREEMPTED_EXIT,
    PREEMPTED_FILE,
)
from titan_plugins.distributed.reaper import Reaper, stop_resource_tracker, tracker_pid
from titan_plugins.failures import (
    ERROR_FILE,
    FAILURE_DIR_ENV,
    INTERRUPTED,
    failure_line,
    first_failure,
    read_failure_records,
    write_error_file,
)
from titan_plugins.run_dir import owned

__all__ = ["FAILURE_DIR_ENV", "PREEMPTED_EXIT", "free_port", "launch", "read_failure_records"]

_first_failure = first_failure  # the name the launcher's tests know

_NOISY = ("torch.distributed.elastic", "torch.distributed.launcher", "torch.distributed.run", "torch.multiprocessing")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _quiet_elastic() -> None:
    # Elastic's module loggers set their own level (LOGLEVEL, default WARNING), so the
    # parents' level is not enough: quiet every one that exists.
    names = [n for n in logging.root.manager.loggerDict if n.startswith(_NOISY)]
    for name in (*_NOISY, *names):
        logging.getLogger(name).setLevel(logging.CRITICAL)


def launch(
    config_path: str | os.PathLike,
    nproc: int,
    entry: Callable[[str], object],
    *,
    error_file: str | os.PathLike | None = None,
    preload: Sequence[str] = (),
    forward: Sequence[signal.Signals] = (),
) -> int:
    """Run ``entry(config_path)`` on ``nproc`` local ranks; returns the job's exit code.
    ``preload``: modules the ranks' fork server imports once (see :func:`_start_method`);
    ``forward``: signals passed on to the ranks (see :func:`_forwarding`)."""
    from torch.distributed.launcher.api import LaunchConfig

    _quiet_elastic()
    os.environ.setdefault("OMP_NUM_THREADS", str(threads_per_rank(nproc)))
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=f"titan-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",  # the OS assigns the port (torchrun --standalone): none picked and bound later
        rdzv_configs={"timeout": 120},
        max_restarts=0,
        monitor_interval=0.1,
        start_method=fork_server.start_method([entry.__module__, *preload], ignored_signals=forward),
    )
    reaper, tracker_before = Reaper(), tracker_pid()
    with owned(Path(config_path).parent):  # no second live job in this run directory
        reaper.start_job()
        # Every rank also writes its failure here: torch's ChildFailedError lists only
        # the processes that had exited when the agent noticed the first failure. Set
        # before the fork server starts: the ranks inherit the server's environment.
        failure_dir = tempfile.mkdtemp(prefix="titan-failures-")
        os.environ[FAILURE_DIR_ENV] = failure_dir
        # The helpers started from here on (fork server, resource tracker) ignore the
        # forwarded signals: a signal to every process of the job (`scancel --full
        # --signal=USR1`, `kill -USR1 -- -PGID`) killed them, and the job with them.
        ignored = {sig: signal.signal(sig, signal.SIG_IGN) for sig in forward}
        try:
            if config.start_method == "forkserver":
                fork_server.ensure_server()
            else:
                from multiprocessing import resource_tracker

                resource_tracker.ensure_running()  # the ranks', started by the first one otherwise
            return _launch(config, fork_server.RankEntry(entry), config_path, error_file, failure_dir, tuple(forward))
        finally:
            for sig, handler in ignored.items():
                signal.signal(sig, signal.SIG_DFL if handler is None else handler)
            os.environ.pop(FAILURE_DIR_ENV, None)
            _end_job(reaper, tracker_before)
            shutil.rmtree(failure_dir, ignore_errors=True)


def _end_job(reaper: Reaper, tracker_before: int | None) -> None:
    """Every process the job left ends: the ranks' leftovers (a fork server waits for
    all its clients before it exits), then this launch's resource tracker (which exits
    once nobody holds its pipe). The fork server stays for the next launch of this
    process (``fork_server``); it exits with this process."""
    reaper.end_job(keep={p for p in (fork_server.server_pid(), tracker_pid()) if p})
    if tracker_before is None:
        stop_resource_tracker()


def _forwarding(config, signals: tuple[signal.Signals, ...], failure_dir: str) -> dict[signal.Signals, object]:
    """Pass each of ``signals`` on to the ranks alone (their pids are in ``failure_dir``),
    instead of the elastic agent's handling (SIGTERM: stop the ranks); returns the
    handlers it replaced."""
    def forward(signum: int, _frame: object) -> None:
        Path(failure_dir, PENDING_FILE).touch()  # for ranks still starting (rank_signals)
        for path in Path(failure_dir).glob(PID_FILE.format(rank="*")):
            try:
                os.kill(int(path.read_text()), signum)
            except (ValueError, OSError):
                pass  # a rank that has exited, or a pid file being replaced

    names = {s.name for s in signals}
    # elastic_launch hands these to the agent (TORCHELASTIC_SIGNALS_TO_HANDLE), whose
    # handler would stop the ranks instead
    config.signals_to_handle = ",".join(
        n for n in (x.strip() for x in config.signals_to_handle.split(",")) if n not in names)
    return {sig: signal.signal(sig, forward) for sig in signals}  # launch runs in the main thread


def _preempted(failure_dir: str, error_file) -> int | None:
    """``PREEMPTED_EXIT`` after printing the ranks' line when they saved and stopped on
    the preemption signal, else ``None``."""
    path = Path(failure_dir) / PREEMPTED_FILE
    if not path.is_file():
        return None
    text = path.read_text().strip()
    print(text, file=sys.stderr, flush=True)
    if error_file is not None:
        write_error_file(Path(error_file).parent, text)
    return PREEMPTED_EXIT


def _launch(config, entry, config_path, error_file, failure_dir: str | None = None, forward=()) -> int:
    """The job under the elastic agent; ``failure_dir``: the ranks' records (``None``:
    a folder of its own, removed after; :func:`launch` makes it before the fork server)."""
    if failure_dir is None:
        failure_dir = tempfile.mkdtemp(prefix="titan-failures-")
        os.environ[FAILURE_DIR_ENV] = failure_dir
        try:
            return _launch(config, entry, config_path, error_file, failure_dir, forward)
        finally:
            os.environ.pop(FAILURE_DIR_ENV, None)
            shutil.rmtree(failure_dir, ignore_errors=True)
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    saved_handled = os.environ.get("TORCHELASTIC_SIGNALS_TO_HANDLE")
    replaced = _forwarding(config, forward, failure_dir) if forward else {}
    try:
        elastic_launch(config, entry)(str(config_path))
        preempted = _preempted(failure_dir, error_file)
        if preempted is not None:
            return preempted
    except ChildFailedError as exc:
        preempted = _preempted(failure_dir, error_file)
        if preempted is not None:  # one rank's exit made the agent stop the others
            return preempted
        rank, text, user, code = first_failure(exc, read_failure_records(failure_dir))
        print(failure_line(text), file=sys.stderr, flush=True)  # one format for every failure
        if error_file is not None:
            write_error_file(Path(error_file).parent, text)
        return code if code > 0 else 1
    except (KeyboardInterrupt, SignalException) as exc:
        # Ctrl-C (or a SIGTERM to the launcher): the agent has stopped the ranks.
        sigterm = isinstance(exc, SignalException) and exc.sigval != 2
        text = f"terminated by signal {exc.sigval.name}" if sigterm else INTERRUPTED
        print(f"error: {text}", file=sys.stderr, flush=True)
        if error_file is not None:
            write_error_file(Path(error_file).parent, text)
        return 128 + int(exc.sigval) if sigterm else 130
    finally:
        for sig, handler in replaced.items():
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)
        if saved_handled is None:
            os.environ.pop("TORCHELASTIC_SIGNALS_TO_HANDLE", None)
        else:
            os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = saved_handled
    return 0


def main(argv: list[str] | None = None) -> int:
    """``CONFIG.yaml NPROC MODULE:FUNCTION``: the entry point named, not imported here."""
    argv = sys.argv[1:] if argv is None else argv
    config_path, nproc, target = argv[0], int(argv[1]), argv[2]
    module, _, name = target.partition(":")
    entry = getattr(importlib.import_module(module), name)
    return launch(config_path, nproc, entry, error_file=Path(config_path).parent / ERROR_FILE)


if __name__ == "__main__":
    sys.exit(main())
