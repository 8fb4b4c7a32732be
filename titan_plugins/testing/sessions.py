"""Test helpers for a job started in a session of its own (``start_new_session=True``:
its pid is the session's and the process group's id)."""

from __future__ import annotations

import os
import signal
import subprocess
import time

__all__ = ["finish"]


def finish(proc: subprocess.Popen, timeout: float) -> tuple[int, str, str]:
    """``(returncode, stdout, stderr)`` of ``proc``; past ``timeout`` seconds its whole
    process group is killed first. ``proc.ended`` is when it was seen to exit (a check
    for processes left behind waits from then)."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
    proc.ended = time.monotonic()
    return proc.returncode, out, err

