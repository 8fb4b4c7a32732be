"""Signals in a rank process: what it inherited is reset, and the preemption signal
(``checkpoint.on_signal``) only raises a flag that the trainer acts on at a step boundary.

A job started in the background of a shell script inherits SIGINT (and SIGQUIT) as
ignored, by POSIX rule, in every process it starts; so do the ranks, and ``nohup``
leaves SIGHUP ignored. The launcher passes the signal it gets on to the ranks and
waits up to 30 s before SIGKILL: ranks that ignore it would train on. Every rank
therefore starts (``reset_inherited``) with the handlers a fresh foreground Python
has, so that SIGINT is a ``KeyboardInterrupt`` and SIGTERM/SIGHUP end it.

``PID_FILE`` (``pid-<rank>`` in the launcher's failure folder): the pid of each rank
that handles the preemption signal, so that the launcher passes it to those ranks
alone (not to the fork server or the data-loader workers, which would die of a
SIGUSR1, nor to a rank still starting, which would too).
"""

from __future__ import annotations

import os
import signal

__all__ = ["PENDING_FILE", "PID_FILE", "PREEMPTED_EXIT", "PREEMPTED_FILE", "install_preemption", "preemption_requested",
           "reset_inherited", "write_pid_file"]

PID_FILE = "pid-{rank}"
_requested: list[signal.Signals] = []


def reset_inherited() -> None:
    """SIGINT raises ``KeyboardInterrupt``; SIGTERM and SIGHUP take their default
    action (the process ends), whatever this process inherited."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)


def write_pid_file(folder: str | os.PathLike | None) -> None:
    """``<folder>/pid-<RANK>`` holds this process's pid (atomically); no folder: nothing."""
    if not folder:
        return
    path = os.path.join(str(folder), PID_FILE.format(rank=os.environ.get("RANK", "0")))
    with open(f"{path}.tmp", "w") as f:
        f.write(str(os.getpid()))
    os.replace(f"{path}.tmp", path)


def install_preemption(sig: signal.Signals) -> None:
    """On ``sig`` only remember that it came (the trainer saves at the next step boundary).

    Then this rank's pid goes to the launcher's folder, and a signal the launcher got
    before (``PENDING_FILE``: while the ranks were starting) counts as received. In
    this order, against the launcher's (write ``PENDING_FILE``, then signal every pid
    file): either the launcher sees the pid file (the handler is in place) or the rank
    sees the pending file."""
    _requested.clear()
    signal.signal(sig, lambda signum, _frame: _requested.append(signal.Signals(signum)))
    folder = os.environ.get("TITAN_FAILURE_DIR")  # failures.FAILURE_DIR_ENV (kept import-free)
    write_pid_file(folder)
    if folder and os.path.exists(os.path.join(folder, PENDING_FILE)):
        _requested.append(sig)


def preemption_requested() -> signal.Signals | None:
    """The preemption signal this rank received, if any."""
    return _requested[0] if _requested else None


# "Preempted, resume me": EX_TEMPFAIL of sysexits.h (a temporary failure; try again).
PREEMPTED_EXIT = 75
PREEMPTED_FILE = "preempted"  # in the launcher's failure folder: the ranks' one line
PENDING_FILE = "signal-pending"  # in the launcher's failure folder: it got the signal
