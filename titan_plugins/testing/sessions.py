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


class WarmJob:
    """``python -m titan_plugins.train.worker CONFIG NPROC`` forked from this process's
    zygote (``titan_plugins.train.zygote``), with what the fault tests use of ``Popen``:
    ``pid`` (its session's id), ``poll``, ``wait``, ``communicate`` (text), ``returncode``.
    Its launcher is the one ``titan-run`` runs, without a new interpreter's ~8 s of imports."""

    def __init__(self, argv: list[str], env: dict[str, str]) -> None:
        import tempfile

        from titan_plugins.train import zygote

        self._out, self._err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
        child = zygote.start(argv, env=env, stdout=self._out.fileno(), stderr=self._err.fileno())
        if child is None:
            raise RuntimeError("no zygote here (TITAN_WARM_START=0, or not Linux)")
        self._child, self.pid, self.returncode = child, child.pid, None

    @staticmethod
    def available() -> bool:
        from titan_plugins.train import zygote

        return zygote.enabled()

    def poll(self) -> int | None:
        try:
            return self.wait(0)
        except subprocess.TimeoutExpired:
            return None

    def wait(self, timeout: float | None = None) -> int:
        self.returncode = self._child.wait(timeout)
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        self.wait(timeout)
        out = []
        for f in (self._out, self._err):
            f.seek(0)
            out.append(f.read())
            f.close()
        return out[0], out[1]
