"""Wait on Slurm's own record of a job, under a deadline, for tests that run real jobs.

    job = submit(["sbatch", "--parsable", "-n", "2", "job.sh"], cwd=folder, env=env)
    wait_until(job.look, time.monotonic() + 300, job.describe)
    assert job.fields["JobState"] == "COMPLETED"

The record is ``scontrol -o show job`` (a test cluster without accounting storage has no
``sacct``): ``JobState``, ``Restarts`` (how often the job was requeued), ``ExitCode``,
``Reason``, ``StdOut``. A job is over when its state is final; a requeued job is
``PENDING`` again with ``Restarts`` counting it, never final, so waiting for the end waits
through every requeue and the job that follows it. A look that gets no answer (slurmctld
busy: ``Socket timed out``) is only that: the job is looked at again, never taken for
over. Slurm forgets a finished job ``MinJobAge`` seconds after it ends, so the final
record is kept (``record``) for the test to read later. When the deadline passes, the
``AssertionError`` shows what is still awaited: each job's last record and its log's tail.
"""

from __future__ import annotations

import re
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["FINAL", "SlurmJob", "show_job", "submit", "wait_until"]

# JobState values after which the job never runs again (a requeue makes it PENDING).
FINAL = frozenset({"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED",
                   "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"})
SCONTROL_TIMEOUT = 30.0  # s; above scontrol's own MessageTimeout (10 s by default)


def show_job(job_id: str) -> str | None:
    """``scontrol -o show job JOB``'s line; ``""`` when Slurm does not know the job (never
    submitted, or forgotten ``MinJobAge`` after it ended); ``None`` when slurmctld did not
    answer (ask again)."""
    try:
        proc = subprocess.run(["scontrol", "-o", "show", "job", job_id], capture_output=True, text=True,
                              timeout=SCONTROL_TIMEOUT)
    except subprocess.TimeoutExpired:
        return None
    if proc.returncode != 0 or not proc.stdout.strip():
        return "" if "Invalid job id" in proc.stderr else None
    return proc.stdout


def submit(argv: list[str], **popen: Any) -> SlurmJob:
    """Run ``argv`` (an ``sbatch --parsable ...``) and return its job."""
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=60, **popen)
    assert proc.returncode == 0, f"{' '.join(argv)} exited {proc.returncode}: {proc.stderr.strip()}"
    return SlurmJob(proc.stdout.strip().split(";")[0])


class SlurmJob:
    """One job as Slurm records it: ``look()`` asks once, ``record``/``fields`` keep the
    last answer (the final one once ``over``)."""

    def __init__(self, job_id: str) -> None:
        self.job_id, self.record, self.fields, self.over = job_id, "", {}, False

    def look(self) -> bool:
        """One look at Slurm's record; True once the job's state is final. A job Slurm
        does not know (any more) before it was seen to end fails: something else
        cancelled it, or it ended more than ``MinJobAge`` seconds ago unseen."""
        if self.over:
            return True
        line = show_job(self.job_id)
        if line is None:
            return False
        assert line, f"job {self.job_id} is gone from Slurm's records before it was seen to end; " \
                     f"last seen: {self.describe()}"
        self.record, self.fields = line, dict(re.findall(r"(\w+)=(\S*)", line))
        self.over = self.fields.get("JobState") in FINAL
        return self.over

    @property
    def state(self) -> str:
        """``JobState (Reason) restarts N exit code C``, or ``not seen yet``."""
        f = self.fields
        if not f:
            return "not seen yet"
        return (f"{f.get('JobState')} ({f.get('Reason')}) restarts {f.get('Restarts')} "
                f"exit code {f.get('ExitCode')}")

    def describe(self, lines: int = 15) -> str:
        """The job's state and the last ``lines`` of its log (Slurm's ``StdOut``)."""
        text = f"job {self.job_id}: {self.state}"
        log = self.fields.get("StdOut")
        if log and Path(log).is_file():
            tail = Path(log).read_text(errors="replace").splitlines()[-lines:]
            text += f"\n  {log} ends:\n" + "\n".join(f"    {line}" for line in tail)
        return text


def wait_until(done: Callable[[], bool], deadline: float, what: Callable[[], str], every: float = 0.5) -> None:
    """Call ``done()`` every ``every`` seconds until it returns True; past ``deadline``
    (``time.monotonic()``) fail with ``what()``: what was awaited, as it stands."""
    start = time.monotonic()
    while not done():
        if time.monotonic() > deadline:
            raise AssertionError(f"still waiting after {time.monotonic() - start:.0f} s:\n{what()}")
        time.sleep(every)
