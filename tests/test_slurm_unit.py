"""Slurm's environment read without Slurm: host lists, where a process is (a job step's
task, an allocation, neither), the ranks' variables and the multi-node master address,
the rendezvous file. The real cluster runs are in tests/test_slurm.py."""

from __future__ import annotations

import json
import os

import pytest

from titan_plugins.distributed import slurm
from titan_plugins.errors import ConfigError


@pytest.fixture(autouse=True)
def _environ_restored():
    # The code under test writes os.environ itself (RANK, WORLD_SIZE, ...); monkeypatch
    # undoes only what it set, so restore the whole environment after each test.
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.mark.parametrize(("hostlist", "hosts"), [
    ("localhost", ["localhost"]),
    ("gpu[01-03,07]", ["gpu01", "gpu02", "gpu03", "gpu07"]),
    ("a[9-11],login1", ["a9", "a10", "a11", "login1"]),
    ("rack[1-2]-n[1-2]", ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]),
    ("node[001-002],gpu-[3,5]", ["node001", "node002", "gpu-3", "gpu-5"]),
])
def test_hostlists_expand_in_order(hostlist, hosts):
    assert slurm.expand_hostlist(hostlist) == hosts


# What srun hands task 3 of an 8-task step on 2 nodes, typed on a login node.
STEP = {
    "SLURM_JOB_ID": "77", "SLURM_STEP_ID": "2", "SLURM_PROCID": "3", "SLURM_LOCALID": "3",
    "SLURM_NODEID": "0", "SLURM_NTASKS": "8", "SLURM_STEP_NUM_TASKS": "8",
    "SLURM_JOB_NODELIST": "gpu[07-08],gpu10", "SLURM_STEP_NODELIST": "gpu[07-08]",
    "SLURM_STEP_TASKS_PER_NODE": "4(x2)", "SLURM_LAUNCH_NODE_IPADDR": "10.0.0.1",
    "SLURM_SUBMIT_HOST": "login1",
}


def test_a_step_task_is_a_rank_and_the_master_is_the_steps_first_node():
    assert slurm.where(STEP) == "step"
    env = slurm.rank_env(STEP)
    assert env == {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "4",
                   "MASTER_ADDR": "gpu07"}  # not the launch node 10.0.0.1 nor login1
    assert "MASTER_PORT" not in env  # rank 0 picks a free one (the rendezvous file)


def test_the_master_falls_back_to_the_jobs_first_node():
    env = {k: v for k, v in STEP.items() if k != "SLURM_STEP_NODELIST"}
    assert slurm.rank_env(env)["MASTER_ADDR"] == "gpu07"
    uneven = {**STEP, "SLURM_STEP_TASKS_PER_NODE": "3,5", "SLURM_NODEID": "1"}
    assert slurm.rank_env(uneven)["LOCAL_WORLD_SIZE"] == "5"


@pytest.mark.parametrize(("env", "expected"), [
    ({}, None),
    ({"SLURM_JOB_ID": "5", "SLURM_NTASKS": "2"}, "allocation"),  # salloc: no SLURM_PROCID
    ({"SLURM_JOB_ID": "5", "SLURM_NTASKS": "2", "SLURM_PROCID": "0"}, "allocation"),  # sbatch script
    ({"SLURM_JOB_ID": "5", "SLURM_NTASKS": "2", "SLURM_PROCID": "0", "SLURM_STEP_ID": "4294967294"},
     "allocation"),  # the batch step by number
    ({"SLURM_JOB_ID": "5", "SLURM_NTASKS": "1", "SLURM_PROCID": "0", "SLURM_STEP_ID": "0"},
     "allocation"),  # srun -n 1: titan-run spawns its ranks
    ({"SLURM_JOB_ID": "5", "SLURM_NTASKS": "2", "SLURM_PROCID": "1", "SLURM_STEP_ID": "0"}, "step"),
])
def test_where_a_process_runs(env, expected):
    assert slurm.where(env) == expected


def test_each_step_has_its_own_run_directory_and_token(monkeypatch):
    from titan_plugins.distributed.external import launch_token

    assert slurm.step_name(STEP) == "slurm-77.2"
    assert slurm.step_name({"SLURM_JOB_ID": "77"}) == "slurm-77.batch"
    tokens = {launch_token({**STEP, "SLURM_STEP_ID": s, "TITAN_LAUNCHED_BY": "slurm"}) for s in "012"}
    tokens.add(launch_token({**STEP, "SLURM_RESTART_COUNT": "1", "TITAN_LAUNCHED_BY": "slurm"}))
    assert len(tokens) == 4


def test_ranks_wait_for_rank_0s_token_only(tmp_path):
    from titan_plugins.distributed.external import publish, wait_published

    publish(tmp_path, "slurm 77.1 restart 0", "gpu07", "31234")  # an earlier step's file
    with pytest.raises(ConfigError, match=r"rank 0 did not claim the run directory .* within 0 s"):
        wait_published(tmp_path, "slurm 77.2 restart 0", timeout=0.2)
    publish(tmp_path, "slurm 77.2 restart 0", "gpu07", "31999")
    assert wait_published(tmp_path, "slurm 77.2 restart 0", timeout=0.2)["port"] == "31999"


def test_slurm_env_becomes_torchrun_env_only_in_a_step(monkeypatch):
    from titan_plugins.cli.run import _slurm_to_torchrun_env

    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TITAN_LAUNCHED_BY"):
        monkeypatch.delenv(key, raising=False)
    for key, value in {"SLURM_JOB_ID": "5", "SLURM_NTASKS": "2"}.items():  # salloc
        monkeypatch.setenv(key, value)
    _slurm_to_torchrun_env()  # was a KeyError on SLURM_PROCID
    assert "RANK" not in os.environ
    for key, value in STEP.items():
        monkeypatch.setenv(key, value)
    _slurm_to_torchrun_env()
    assert (os.environ["RANK"], os.environ["MASTER_ADDR"], os.environ["TITAN_LAUNCHED_BY"]) == ("3", "gpu07", "slurm")


def test_a_sweep_job_that_left_no_result_is_listed_as_failed(tmp_path):
    # A submitit job that Slurm killed (time limit, OOM, scancel) before its task wrote
    # result.json: the summary still lists it, as failed, and the sweep fails.
    from titan_plugins.train.sweep import FAILED_JOBS, print_summary, read_results

    (tmp_path / "0_lr=1").mkdir()
    (tmp_path / "0_lr=1" / "result.json").write_text(json.dumps(
        {"job": "0", "overrides": "lr=1", "final_loss": 1.5, "tokens_per_s": 10.0, "status": "ok"}))
    (tmp_path / "1_lr=2").mkdir()
    (tmp_path / ".submitit").mkdir()
    results = read_results(tmp_path)
    assert [(r["job"], r["status"]) for r in results] == [("0", "ok"), ("1", "failed")]
    print_summary(tmp_path)
    assert FAILED_JOBS == ["1"]


def test_result_json_says_which_job_and_step(tmp_path, monkeypatch):
    from titan_plugins.train.sweep import write_result

    for key, value in {**STEP, "TITAN_LAUNCHED_BY": "slurm", "MASTER_ADDR": "gpu07", "MASTER_PORT": "31000",
                       "WORLD_SIZE": "8"}.items():
        monkeypatch.setenv(key, value)
    record = write_result(tmp_path, job="0", overrides="", returncode=0)
    assert record["launch"] == {"by": "slurm", "slurm_job_id": "77", "slurm_step_id": "2",
                                "slurm_nodelist": "gpu[07-08]", "master": "gpu07:31000", "world_size": 8}
    assert json.loads((tmp_path / "result.json").read_text())["launch"]["slurm_step_id"] == "2"
