"""The launcher ends every process its job started, on every exit path.

The ranks fork from a fork server and start data-loader workers of their own; when
a rank dies (SIGKILL, the OOM killer, the agent's SIGTERM) what it started is
re-parented to init and can live on (a worker watching a parent that still lives,
a fork server waiting for a client that will not come back), holding the job's
pipes, ports and memory. So during a job the launching process is a *child
subreaper* (Linux ``PR_SET_CHILD_SUBREAPER``): orphans of the job are re-parented
to it instead of init, and ``Reaper.end_job`` kills and reaps every descendant the
job left, except the processes that were there before it started.

Elsewhere (no ``prctl``) the reaper only kills the descendants it can still see.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import time
from pathlib import Path

__all__ = ["Reaper", "descendants"]

_PR_SET_CHILD_SUBREAPER = 36
_PR_GET_CHILD_SUBREAPER = 37


def _prctl(option: int, arg: int | ctypes.c_int | ctypes._Pointer) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(option, arg, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _parents() -> dict[int, int]:
    """pid -> parent pid of every process this user can see (Linux ``/proc``)."""
    out: dict[int, int] = {}
    for entry in Path("/proc").iterdir() if Path("/proc").is_dir() else ():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue  # gone meanwhile
        out[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    return out


def descendants(pid: int) -> list[int]:
    """Every live (or not yet reaped) descendant of ``pid``, parents before children."""
    children: dict[int, list[int]] = {}
    for child, parent in _parents().items():
        children.setdefault(parent, []).append(child)
    found, todo = [], list(children.get(pid, []))
    while todo:
        p = todo.pop(0)
        found.append(p)
        todo += children.get(p, [])
    return found


class Reaper:
    """``start_job()`` before the ranks start, ``end_job()`` after (in a ``finally``)."""

    def __init__(self) -> None:
        self._before: set[int] = set()
        self._was_subreaper: int | None = None

    def start_job(self) -> None:
        self._before = set(descendants(os.getpid()))
        flag = ctypes.c_int(0)
        if _prctl(_PR_GET_CHILD_SUBREAPER, ctypes.pointer(flag)) and _prctl(_PR_SET_CHILD_SUBREAPER, 1):
            self._was_subreaper = flag.value

    def end_job(self, keep: set[int] = frozenset()) -> list[int]:
        """SIGKILL and reap what the job left (``keep``: pids to leave alone, e.g. a
        fork server stopped by its owner); returns the pids it killed."""
        me = os.getpid()
        left = [p for p in descendants(me) if p not in self._before and p not in keep]
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        # Reap the ones re-parented to this process (the others' parents reap them).
        deadline = time.monotonic() + 5.0
        for pid in left:
            while True:
                try:
                    done, _ = os.waitpid(pid, os.WNOHANG)
                except ChildProcessError:
                    break  # not this process's child (its own parent reaps it)
                if done or time.monotonic() > deadline:
                    break
                time.sleep(0.01)
        if self._was_subreaper is not None:
            _prctl(_PR_SET_CHILD_SUBREAPER, self._was_subreaper)
            self._was_subreaper = None
        return left


def tracker_pid() -> int | None:
    """The pid of this process's multiprocessing resource tracker, if one runs."""
    from multiprocessing import resource_tracker

    return getattr(resource_tracker._resource_tracker, "_pid", None)


def stop_resource_tracker(timeout: float = 3.0) -> None:
    """Stop this process's resource tracker (it restarts on next use). It exits once
    every holder of its pipe is gone, which ``Reaper.end_job`` made sure of; one that
    still runs after ``timeout`` is killed. CPython's own ``_stop`` would wait forever."""
    from multiprocessing import resource_tracker

    tracker = resource_tracker._resource_tracker
    with tracker._lock:
        fd, pid = getattr(tracker, "_fd", None), getattr(tracker, "_pid", None)
        if fd is None or pid is None:
            return
        os.close(fd)
        tracker._fd, tracker._pid = None, None
        deadline = time.monotonic() + timeout
        try:
            while not os.waitpid(pid, os.WNOHANG)[0]:
                if time.monotonic() > deadline:
                    os.kill(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)
                    break
                time.sleep(0.01)
        except ChildProcessError:
            pass
