"""Every documented way to run on Slurm, against a real one-node cluster
(scripts/slurm/start_cluster.sh; .ci/run starts it before the tests). Without one (not
root, no Slurm) every test here skips with one line.

All runs start at once (one cluster, a node of 16 declared CPUs) and the tests read what
they left: an sbatch job with two concurrent ``srun`` steps (one fails on rank 1), an
sbatch job without ``srun`` (titan-run starts its own ranks in the allocation), an
``salloc``, and a submitit sweep with two tasks per job (one job fails).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
TESTS = str(Path(__file__).parent)
RUN = ("model=tiny training.seq_len=32 training.steps=2 training.local_batch_size=1 "
       "metrics.tensorboard=false metrics.console=false")
TIMEOUT = 300


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


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "PYTEST_", "TITAN_RUN_DIR")) and k not in
           ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TITAN_LAUNCHED_BY")}
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env["TITAN_PLUGINS_EXTRA"] = "tiny_plugin"
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


@pytest.fixture(scope="module")
def runs(slurm_cluster, tmp_path_factory):
    """Start every kind of run at once; wait for all; hand over their folders and outputs."""
    base = tmp_path_factory.mktemp("slurm")
    dirs = {name: base / name for name in ("steps", "batch", "salloc", "sweep")}
    for d in dirs.values():
        d.mkdir()
    (dirs["steps"] / "steps.sh").write_text(STEPS)
    commands = {
        "steps": ["sbatch", "--wait", "-n", "4", "-o", "job.out", "steps.sh"],
        "batch": ["sbatch", "--wait", "-n", "2", "-o", "job.out", "--wrap", f"titan-run {RUN} parallelism=fsdp2"],
        # two tasks allocated, no step: SLURM_NTASKS=2 without SLURM_PROCID (was a KeyError)
        "salloc": ["salloc", "-n", "2", "titan-run", *RUN.split()],
        "sweep": ["titan-run", "-m", "hydra/launcher=submitit_slurm", "hydra.launcher.tasks_per_node=2",
                  "hydra.launcher.timeout_min=10", *RUN.split(), "parallelism=fsdp2", "model.fail_on_rank=-1,1"],
    }
    start = time.monotonic()
    procs = {name: subprocess.Popen(cmd, cwd=dirs[name], env=_env(), stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True) for name, cmd in commands.items()}
    out = {}
    try:
        for name, proc in procs.items():
            stdout, stderr = proc.communicate(timeout=TIMEOUT)
            out[name] = (proc.returncode, stdout, stderr)
    finally:
        for proc in procs.values():
            proc.kill()
    print(f"slurm runs: {time.monotonic() - start:.1f} s", file=sys.stderr)
    return dirs, out


def _result(run_dir: Path) -> dict:
    return json.loads((run_dir / "result.json").read_text())


def _losses(run_dir: Path) -> list[float]:
    from titan_plugins.train.api import read_result

    return read_result(run_dir).losses


def test_srun_steps_of_one_job_run_side_by_side_each_in_its_own_run_directory(runs):
    dirs, out = runs
    log = (dirs["steps"] / "job.out").read_text()
    step_dirs = sorted((dirs["steps"] / "outputs").glob("slurm-*.*"))
    assert len(step_dirs) == 2, log
    results = [_result(d) for d in step_dirs]
    ok = [r for r in results if r["status"] == "ok"]
    assert len(ok) == 1, log
    assert ok[0]["steps"] == 2 and ok[0]["launch"]["by"] == "slurm" and ok[0]["launch"]["world_size"] == 2
    (job_id,) = {r["launch"]["slurm_job_id"] for r in results}  # one job ...
    assert {r["launch"]["slurm_step_id"] for r in results} == {"0", "1"}  # ... two steps
    assert {d.name for d in step_dirs} == {f"slurm-{job_id}.0", f"slurm-{job_id}.1"}
    assert len({r["launch"]["master"] for r in results}) == 2  # a port per step


def test_a_failing_rank_ends_its_step_with_one_error_line(runs):
    dirs, out = runs
    log = (dirs["steps"] / "job.out").read_text()
    assert "steps 0 " in log and "steps 0 0" not in log, log  # the failing step exited non-zero
    errors = [line for line in log.splitlines() if line.startswith("error:")]
    assert errors == ["error: rank 1 crashed: RuntimeError: tiny: injected failure on rank 1"], log
    failed = [r for r in map(_result, (dirs["steps"] / "outputs").glob("slurm-*")) if r["status"] != "ok"]
    assert failed[0]["error"].startswith("rank 1 crashed: RuntimeError: tiny: injected failure on rank 1")


def test_sbatch_without_srun_starts_its_own_ranks_like_a_workstation(runs):
    dirs, out = runs
    code, stdout, stderr = out["batch"]
    log = (dirs["batch"] / "job.out").read_text()
    assert code == 0, log
    (run_dir,) = (dirs["batch"] / "outputs").glob("*/*")  # the default, claimed directory
    result = _result(run_dir)
    assert result["status"] == "ok" and result["steps"] == 2, result
    assert result["launch"]["by"] == "titan-run" and result["launch"]["slurm_job_id"]
    # the same run as the srun step's: Slurm tasks as ranks train bit for bit like spawned ranks
    (srun_ok,) = [d for d in (dirs["steps"] / "outputs").glob("slurm-*") if _result(d)["status"] == "ok"]
    assert _losses(srun_ok) == _losses(run_dir)


def test_salloc_runs_titan_run_in_the_allocation(runs):
    dirs, out = runs
    code, stdout, stderr = out["salloc"]
    assert code == 0, stderr[-3000:]
    (run_dir,) = (dirs["salloc"] / "outputs").glob("*/*")
    result = _result(run_dir)
    assert result["status"] == "ok" and result["launch"]["slurm_job_id"], result


def test_submitit_sweep_one_directory_all_jobs_listed_failure_fails_the_sweep(runs):
    dirs, out = runs
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
