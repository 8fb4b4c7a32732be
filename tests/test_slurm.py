"""Every documented way to run on Slurm, against a real one-node cluster
(scripts/slurm/start_cluster.sh; .ci/run starts it before the tests). Without one (not
root, no Slurm) every test here skips with one line.

All runs start at once (one cluster, a node of 16 declared CPUs) and the tests read what
they left: an sbatch job with two concurrent ``srun`` steps (one fails on rank 1), an
sbatch job without ``srun`` (titan-run starts its own ranks in the allocation: the
``--requeue`` recipe of docs/running.md as written, preempted after step 3 by the signal
that ``--signal=B:USR1@T`` sends, requeued, resumed), an sbatch job whose ``srun`` step
is preempted by ``scancel --signal=TERM`` (``checkpoint.on_signal=TERM``), requeued,
resumed, an ``salloc``, and a submitit sweep with two tasks per job (one job fails).

Nothing here sleeps for a fixed time or reads a log while a job may still write it: the
fixture waits on Slurm's own record of each job (``titan_plugins.testing.slurm_jobs``:
``JobState`` final, which a requeued job is not until its next run has ended) and on the
``salloc`` and sweep commands' exits, all under one deadline that fails showing every
job's state and log tail.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple

import pytest

from titan_plugins.distributed.reaper import descendants
from titan_plugins.testing.slurm_jobs import SlurmJob, submit, wait_until

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
TESTS = str(Path(__file__).parent)
RUN = ("model=tiny training.seq_len=32 training.steps=4 training.local_batch_size=1 "
       "metrics.tensorboard=false metrics.console=false")
DEADLINE = 420  # s for every run together (~2 min on 2 busy cores); passing it fails, naming what is left
PREEMPT = "checkpoint=periodic checkpoint.interval=2"  # step-2 saved before the signal after step 3


def _slurm_up() -> bool:
    if not shutil.which("sinfo"):
        return False
    out = subprocess.run(["sinfo", "-h", "-N", "-o", "%t"], capture_output=True, text=True, timeout=20)
    return out.returncode == 0 and out.stdout.split()[:1] in (["idle"], ["mix"], ["alloc"])


@pytest.fixture(scope="session")
def slurm_cluster():
    """The one-node cluster of this test run (started here, and stopped after, if .ci/run
    or the user did not start one)."""
    if _slurm_up():
        yield
        return
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "slurm" / "start_cluster.sh")],
                          capture_output=True, text=True, timeout=600)
    if proc.returncode != 0 or not _slurm_up():
        lines = (proc.stderr or proc.stdout).strip().splitlines() or ["no output"]
        pytest.skip(f"no Slurm here: {lines[-1]}")
    yield
    subprocess.run(["bash", str(ROOT / "scripts" / "slurm" / "stop_cluster.sh")], capture_output=True, timeout=60)


def _env(park_after: int = 0) -> dict[str, str]:
    """``park_after``: the ranks wait after that step for a signal (``fault_plugin``)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "PYTEST_", "TITAN_RUN_DIR", "TITAN_TEST_")) and k not in
           ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TITAN_LAUNCHED_BY")}
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env["TITAN_PLUGINS_EXTRA"] = "tiny_plugin"
    if park_after:
        env["TITAN_PLUGINS_EXTRA"] = "tiny_plugin,fault_plugin"
        env["TITAN_TEST_PARK_AFTER"] = str(park_after)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (TESTS, env.get("PYTHONPATH", "")) if p)
    env["OMP_NUM_THREADS"] = "1"
    return env


STEPS = f"""#!/bin/bash
srun -n 2 --exact --kill-on-bad-exit=1 titan-run {RUN} parallelism=fsdp2 &
srun -n 2 --exact --kill-on-bad-exit=1 titan-run {RUN} parallelism=fsdp2 model.fail_on_rank=1 &
wait %1; ok=$?
wait %2; failed=$?
echo "steps $ok $failed"
"""


# A job step preempted by Slurm's own signal (every process of the step gets it); the
# step exits 75 and the script requeues.
SRUN_TERM = f"""#!/bin/bash
srun -n 2 --kill-on-bad-exit=1 titan-run {RUN} parallelism=fsdp2 {PREEMPT} checkpoint.on_signal=TERM
code=$?
echo "srun exit $code restarts ${{SLURM_RESTART_COUNT:-0}}"
[ "$code" -eq 75 ] && scontrol requeue "$SLURM_JOB_ID"
exit "$code"
"""


def docs_recipe() -> str:
    """The sbatch ``--requeue`` recipe of docs/running.md ("Faults and resuming") as
    written, but for the model and the number of tasks."""
    text = (ROOT / "docs" / "running.md").read_text()
    match = re.search(r"\n( +)#!/bin/bash\n\1#SBATCH -n 8 --time=4:00:00 --requeue.*?\n(?!\1)", text, re.S)
    assert match, "docs/running.md: the sbatch --requeue recipe is gone"
    indent = len(match.group(1))
    script = "".join(line[indent:] + "\n" for line in match.group(0).strip("\n").splitlines())
    for old, new in (("-n 8 ", "-n 2 "), ("titan-run model=qwen3 parallelism=fsdp8 ",
                                          f"titan-run {RUN} parallelism=fsdp2 checkpoint.interval=2 ")):
        assert script.count(old) == 1, (old, script)
        script = script.replace(old, new)
    return script


class Preempted:
    """A job whose ranks wait after step 3: once both wait, ``scancel SIGNAL_ARGS JOB``. The
    job requeues itself; Slurm holds it ``cred_expire`` seconds (20 on the test cluster,
    120 by default), then runs it again. Releasing the hold early (``scontrol update
    StartTime=now``) within the requeue's second failed the job: "Job credential revoked"."""

    def __init__(self, job: SlurmJob, run_dir: Path, scancel: list[str]) -> None:
        self.job, self.run_dir, self.scancel, self.signalled = job, run_dir, scancel, False

    def look(self) -> bool:
        """One look; True once Slurm records the job as over (a requeued job is PENDING,
        then runs again: over means after its resumed run)."""
        if not self.signalled and all((self.run_dir / f"parked-{r}").exists() for r in (0, 1)):
            subprocess.run(["scancel", *self.scancel, self.job.job_id], check=True, timeout=30)
            self.signalled = True
        return self.job.look()

    def describe(self) -> str:
        return f"{self.job.describe()}\n  {'signalled' if self.signalled else 'ranks not both parked yet'}"


class Runs(NamedTuple):
    dirs: dict[str, Path]  # each run's folder
    out: dict[str, tuple[int, str, str]]  # salloc's and the sweep's exit code, stdout, stderr
    jobs: dict[str, str]  # the sbatch jobs' ids
    records: dict[str, str]  # the sbatch jobs' final ``scontrol -o show job`` (Slurm forgets them MinJobAge after)


def _queued() -> set[str]:
    out = subprocess.run(["squeue", "-h", "-o", "%A"], capture_output=True, text=True, timeout=30).stdout
    return set(out.split())


class Command:
    """``salloc`` or the sweep: a command that ends when its jobs have; its output in files
    (a pipe nobody reads while it runs could fill and stop it)."""

    def __init__(self, argv: list[str], folder: Path, name: str) -> None:
        self.argv, self.files = argv, (folder / f"{name}.stdout", folder / f"{name}.stderr")
        with self.files[0].open("w") as stdout, self.files[1].open("w") as stderr:
            self.proc = subprocess.Popen(argv, cwd=folder, env=_env(), stdout=stdout, stderr=stderr)

    def look(self) -> bool:
        return self.proc.poll() is not None

    def stop(self) -> None:
        """Kill the command and all it started (salloc puts its command in a process group
        of its own: killed alone, salloc would leave titan-run and its ranks running)."""
        for pid in [self.proc.pid, *descendants(self.proc.pid)]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.proc.wait(timeout=30)

    def output(self) -> tuple[int, str, str]:
        return self.proc.returncode, self.files[0].read_text(), self.files[1].read_text()

    def describe(self) -> str:
        code = "running" if self.proc.poll() is None else f"exit {self.proc.returncode}"
        text = f"{' '.join(self.argv[:3])} ...: {code}"
        for path in self.files:
            tail = path.read_text(errors="replace").splitlines()[-10:]
            text += f"\n  {path.name} ends:\n" + "\n".join(f"    {line}" for line in tail)
        return text


@pytest.fixture(scope="module")
def runs(slurm_cluster, tmp_path_factory) -> Runs:
    """Start every kind of run at once; wait until Slurm records every sbatch job as over
    and salloc and the sweep have exited; hand over their folders, outputs and records."""
    base = tmp_path_factory.mktemp("slurm")
    dirs = {name: base / name for name in ("steps", "batch", "srun_term", "salloc", "sweep")}
    for d in dirs.values():
        d.mkdir()
    (dirs["steps"] / "steps.sh").write_text(STEPS)
    (dirs["batch"] / "recipe.sh").write_text(docs_recipe())
    (dirs["srun_term"] / "job.sh").write_text(SRUN_TERM)
    commands = {
        # two tasks allocated, no step: SLURM_NTASKS=2 without SLURM_PROCID (was a KeyError)
        "salloc": ["salloc", "-n", "2", "titan-run", *RUN.split()],
        "sweep": ["titan-run", "-m", "hydra/launcher=submitit_slurm", "hydra.launcher.tasks_per_node=2",
                  "hydra.launcher.timeout_min=10", *RUN.split(), "parallelism=fsdp2", "model.fail_on_rank=-1,1"],
    }
    preempted = {  # what --signal=B:USR1@T sends to the batch shell; Slurm's SIGTERM to a step
        "batch": (["sbatch", "--parsable", "-o", "job.out", "recipe.sh"], "outputs/job-{job}", ["--batch", "--signal=USR1"]),
        "srun_term": (["sbatch", "--parsable", "-n", "2", "--requeue", "--open-mode=append", "-o", "job.out", "job.sh"],
                      "outputs/slurm-{job}.0", ["--signal=TERM"]),
    }
    start = time.monotonic()
    before = _queued()
    procs: dict[str, Command] = {}
    sbatched: list[SlurmJob] = []
    jobs: dict[str, Preempted] = {}
    try:
        procs = {name: Command(cmd, dirs[name], name) for name, cmd in commands.items()}
        sbatched.append(submit(["sbatch", "--parsable", "-n", "4", "-o", "job.out", "steps.sh"], cwd=dirs["steps"],
                               env=_env()))
        for name, (cmd, run_dir, scancel) in preempted.items():
            sbatched.append(job := submit(cmd, cwd=dirs[name], env=_env(park_after=3)))
            jobs[name] = Preempted(job, dirs[name] / run_dir.format(job=job.job_id), scancel)
        waiting = {"steps": sbatched[0], **jobs, **procs}

        def over() -> bool:
            for name in [name for name, what in waiting.items() if what.look()]:
                del waiting[name]
            return not waiting

        wait_until(over, start + DEADLINE,
                   lambda: "\n".join(f"{name}: {what.describe()}" for name, what in waiting.items()))
    finally:  # on a failure: nothing left running
        if not all(cmd.look() for cmd in procs.values()):  # their allocations would outlive them
            for cmd in procs.values():
                cmd.stop()
            subprocess.run(["scancel", *(_queued() - before)], capture_output=True, timeout=30)
        for job in sbatched:
            if not job.over:
                subprocess.run(["scancel", job.job_id], capture_output=True, timeout=30)
    out = {name: cmd.output() for name, cmd in procs.items()}
    print(f"slurm runs: {time.monotonic() - start:.1f} s", file=sys.stderr)
    return Runs(dirs, out, {name: job.job.job_id for name, job in jobs.items()},
                {name: job.job.record for name, job in jobs.items()})


def _result(run_dir: Path) -> dict:
    return json.loads((run_dir / "result.json").read_text())


def test_srun_steps_of_one_job_run_side_by_side_each_in_its_own_run_directory(runs):
    dirs, out, _, _ = runs
    log = (dirs["steps"] / "job.out").read_text()
    step_dirs = sorted((dirs["steps"] / "outputs").glob("slurm-*.*"))
    assert len(step_dirs) == 2, log
    results = [_result(d) for d in step_dirs]
    ok = [r for r in results if r["status"] == "ok"]
    assert len(ok) == 1, log
    assert ok[0]["steps"] == 4 and ok[0]["launch"]["by"] == "slurm" and ok[0]["launch"]["world_size"] == 2
    (job_id,) = {r["launch"]["slurm_job_id"] for r in results}  # one job ...
    assert {r["launch"]["slurm_step_id"] for r in results} == {"0", "1"}  # ... two steps
    assert {d.name for d in step_dirs} == {f"slurm-{job_id}.0", f"slurm-{job_id}.1"}
    assert len({r["launch"]["master"] for r in results}) == 2  # a port per step


def test_a_failing_rank_ends_its_step_with_one_error_line(runs):
    dirs, out, _, _ = runs
    log = (dirs["steps"] / "job.out").read_text()
    assert "steps 0 " in log and "steps 0 0" not in log, log  # the failing step exited non-zero
    errors = [line for line in log.splitlines() if line.startswith("error:")]
    assert errors == ["error: rank 1 crashed: RuntimeError: tiny: injected failure on rank 1"], log
    failed = [r for r in map(_result, (dirs["steps"] / "outputs").glob("slurm-*")) if r["status"] != "ok"]
    assert failed[0]["error"].startswith("rank 1 crashed: RuntimeError: tiny: injected failure on rank 1")


def _steps(run_dir: Path) -> list[tuple[float, float]]:
    from titan_plugins.train.api import read_result

    result = read_result(run_dir)
    return list(zip(result.losses, result.grad_norms))


def _srun_ok(dirs: dict[str, Path]) -> Path:
    (srun_ok,) = [d for d in (dirs["steps"] / "outputs").glob("slurm-*") if _result(d)["status"] == "ok"]
    return srun_ok


def test_sbatch_without_srun_starts_its_own_ranks_like_a_workstation(runs):
    dirs, out, jobs, _ = runs
    log = (dirs["batch"] / "job.out").read_text()
    run_dir = dirs["batch"] / "outputs" / f"job-{jobs['batch']}"  # the recipe's hydra.run.dir
    result = _result(run_dir)
    assert result["status"] == "ok" and result["steps"] == 4, log
    assert result["launch"]["by"] == "titan-run" and result["launch"]["slurm_job_id"] == jobs["batch"]
    # the same run as the srun step's: Slurm tasks as ranks train bit for bit like spawned ranks
    # (this one was also preempted after step 3 and resumed: the next test)
    assert _steps(_srun_ok(dirs)) == _steps(run_dir)


def test_the_docs_sbatch_recipe_saves_on_the_batch_signal_requeues_and_resumes_bit_for_bit(runs):
    """docs/running.md's recipe as written: USR1 to the batch shell (what
    ``--signal=B:USR1@180`` sends 3 minutes before the time limit), which passes it on to
    titan-run; the ranks save step-3, titan-run exits 75, the script requeues the job, and
    the requeued job (same job id, same run directory) resumes from step-3: steps 1-4
    equal the uninterrupted srun step's, loss and gradient norm."""
    dirs, out, jobs, records = runs
    log = (dirs["batch"] / "job.out").read_text()
    run_dir = dirs["batch"] / "outputs" / f"job-{jobs['batch']}"
    step3 = run_dir.resolve() / "checkpoints" / "step-3"
    assert (f"preempted: SIGUSR1 at step 3: checkpoint {step3} saved; exit 75: run the same command again to "
            "resume") in log.splitlines(), log
    assert f"resumed from checkpoint {step3} (step 3)" in log, log
    info = records["batch"]  # Slurm's record when the job ended, not MinJobAge later
    assert "JobState=COMPLETED" in info and "Restarts=1 " in info and "ExitCode=0:0" in info, info
    assert _steps(run_dir) == _steps(_srun_ok(dirs))


def test_an_srun_step_saves_on_slurms_sigterm_exits_75_and_resumes_bit_for_bit(runs):
    """``checkpoint.on_signal=TERM`` under ``srun --kill-on-bad-exit``: ``scancel
    --signal=TERM`` reaches every process of the step; both ranks save step-3 and exit
    75, so does srun (a rank still shutting down used to be killed by Slurm when the
    first had exited: 143, no requeue); the requeued job's step (``slurm-<job>.0``
    again) resumes from step-3 and trains step 4 like the uninterrupted srun step."""
    dirs, out, jobs, _ = runs
    log = (dirs["srun_term"] / "job.out").read_text()
    run_dir = dirs["srun_term"] / "outputs" / f"slurm-{jobs['srun_term']}.0"
    step3 = run_dir.resolve() / "checkpoints" / "step-3"
    assert [line for line in log.splitlines() if line.startswith("srun exit")] == [
        "srun exit 75 restarts 0", "srun exit 0 restarts 1"], log
    assert f"preempted: SIGTERM at step 3: checkpoint {step3} saved; exit 75" in log, log
    assert "Traceback" not in log, log
    assert f"resumed from checkpoint {step3} (step 3)" in log, log
    result = _result(run_dir)
    assert result["status"] == "ok" and result["steps"] == 4 and result["launch"]["by"] == "slurm", result
    assert _steps(run_dir) == _steps(_srun_ok(dirs))


def test_salloc_runs_titan_run_in_the_allocation(runs):
    dirs, out, _, _ = runs
    code, stdout, stderr = out["salloc"]
    assert code == 0, stderr[-3000:]
    (run_dir,) = (dirs["salloc"] / "outputs").glob("*/*")
    result = _result(run_dir)
    assert result["status"] == "ok" and result["launch"]["slurm_job_id"], result


def test_submitit_sweep_one_directory_all_jobs_listed_failure_fails_the_sweep(runs):
    dirs, out, _, _ = runs
    code, stdout, stderr = out["sweep"]
    assert code == 1, stdout[-3000:] + stderr[-3000:]
    (sweep,) = (dirs["sweep"] / "multirun").glob("*/*")  # one directory for the sweep
    jobs = sorted(p for p in sweep.iterdir() if p.is_dir() and not p.name.startswith("."))
    assert [p.name[:2] for p in jobs] == ["0_", "1_"]  # one per job; both ranks of a job in it
    assert f"sweep {sweep.relative_to(dirs['sweep'])}: 2 jobs, 1 failed" in stdout, stdout
    table = stdout.split("1 failed\n", 1)[1]
    assert "model.fail_on_rank=-1" in table and " ok" in table
    assert "failed: rank 1 crashed: RuntimeError: tiny: injected failure on rank 1" in table
    results = [_result(p) for p in jobs]
    assert [r["launch"]["world_size"] for r in results] == [2, 2]  # Slurm tasks as ranks
    assert len({r["launch"]["slurm_job_id"] for r in results}) == 2
