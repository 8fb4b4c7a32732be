"""Real runs on gloo (1, 2, 4 and 8 spawned ranks) of the tiny test model.

Each run is a few steps at seq 32; equalities are exact where the arithmetic is
the same (resume), and ~1e-5 where only float reordering differs (parallelism).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from titan_plugins.train.api import run

pytestmark = pytest.mark.slow
BASE = ["model=tiny", "training.seq_len=32", "metrics.tensorboard=false", "metrics.console=false"]
EXTRA = ["tiny_plugin"]
TIMEOUT = 240


def _run(tmp, name, *overrides, check=True):
    result = run([*BASE, *overrides], run_dir=tmp / name, extra_plugins=EXTRA, timeout=TIMEOUT)
    if check:
        assert result.returncode == 0, f"{name}: {result.error}\n{result.stderr[-3000:]}"
    return result


@pytest.fixture(scope="module")
def seeded(tmp_path_factory):
    """A seed checkpoint and the single-rank reference losses from it (4 sequences/step)."""
    tmp = tmp_path_factory.mktemp("seed")
    _run(tmp, "seed", "checkpoint.create_seed=true")
    seed = tmp / "seed" / "checkpoints" / "seed"
    assert (seed / ".metadata").is_file()
    ref = _run(tmp, "single", f"checkpoint.init_from={seed}", "training.steps=3", "training.local_batch_size=4")
    return seed, ref.losses


def test_hsdp_and_grad_accum_match_single_rank(tmp_path, seeded):
    seed, ref = seeded
    hsdp = _run(tmp_path, "hsdp", "parallelism=hsdp2_fsdp2", f"checkpoint.init_from={seed}", "training.steps=3",
                "training.local_batch_size=1")
    assert hsdp.losses == pytest.approx(ref, rel=1e-5, abs=1e-5)


@pytest.mark.parametrize(  # GPipe in make test-all: 1F1B and the interleaved one cover the stage code
    "schedule", [pytest.param("GPipe", marks=pytest.mark.extended), "1F1B", "Interleaved1F1B"]
)
def test_pipeline_schedules_match_single_rank(tmp_path, seeded, schedule):
    seed, ref = seeded
    extra = ["parallelism.pp_stages_per_rank=2"] if schedule == "Interleaved1F1B" else []
    pp = _run(tmp_path, schedule, "parallelism=pp2", f"parallelism.pp_schedule={schedule}", *extra,
              f"checkpoint.init_from={seed}", "training.steps=3", "training.local_batch_size=4")
    assert pp.losses == pytest.approx(ref, rel=1e-5, abs=1e-5)
    assert all(g > 0 for g in pp.grad_norms)


def test_fsdp_tp_pp_matches_single_rank(tmp_path, seeded):
    seed, ref = seeded
    # 8 ranks: dp 2 x tp 2 x pp 2; 2 sequences per DP rank = the reference's 4.
    r = _run(tmp_path, "3d", "parallelism=fsdp2_tp2_pp2", f"checkpoint.init_from={seed}", "training.steps=3",
             "training.local_batch_size=2", "parallelism.pp_microbatches=2", "training.dump_final_params=true")
    assert r.losses == pytest.approx(ref, rel=1e-5, abs=1e-5)
    import torch

    params = torch.load(tmp_path / "3d" / "final_params.pt")
    assert params["tok_embeddings.weight"].shape == (2048, 32) and "layers.3.attention.wq.weight" in params
    assert not any("freqs_cis" in k for k in params)


def test_resume_is_exact_and_checkpoint_loads_under_other_parallelism(tmp_path):
    ckpt = ["checkpoint.enabled=true", "checkpoint.interval=2", "training.local_batch_size=2"]
    full = _run(tmp_path, "full", "parallelism=fsdp2", "training.steps=4", *ckpt)
    _run(tmp_path, "resumed", "parallelism=fsdp2", "training.steps=2", *ckpt)
    folder = tmp_path / "resumed" / "checkpoints"
    assert sorted(p.name for p in folder.iterdir()) == ["step-2"]
    # fsdp2 (2 x 2 sequences) -> tp2 (1 x 4 sequences): same data, same weights and optimizer.
    tp = _run(tmp_path, "tp2", "parallelism=tp2", "training.steps=3", "checkpoint.enabled=true",
              f"checkpoint.folder={folder}", "checkpoint.interval=1000", "checkpoint.save_final=false",
              "training.local_batch_size=4")
    assert tp.steps == [3]
    assert tp.losses[0] == pytest.approx(full.losses[2], rel=1e-5)
    resumed = _run(tmp_path, "resumed", "parallelism=fsdp2", "training.steps=4", *ckpt, "checkpoint.keep_last=1")
    assert resumed.steps == [1, 2, 3, 4]
    assert resumed.losses == full.losses  # bit for bit
    assert resumed.grad_norms == full.grad_norms
    assert sorted(p.name for p in folder.iterdir()) == ["step-4"]


def test_failing_rank_ends_the_job_with_its_error(tmp_path):
    r = _run(tmp_path, "fail", "parallelism=fsdp2", "model.fail_on_rank=1", "training.steps=2", check=False)
    assert r.returncode == 1
    assert r.error.startswith("rank 1 crashed: RuntimeError: tiny: injected failure on rank 1")
    assert r.stderr.count("injected failure on rank 1") <= 2  # the first line + the traceback's last


def test_multirun_reports_failed_job_and_goes_on(tmp_path):
    # The failing job is the second one launched from this process: its ranks must see
    # its own failure directory (each launch starts its own fork server).
    import os

    env = {**os.environ, "TITAN_PLUGINS_EXTRA": "tiny_plugin",
           "PYTHONPATH": os.pathsep.join([os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")])}
    sweep = tmp_path / "sweep"
    proc = subprocess.run(
        [sys.executable, "-m", "titan_plugins.cli.run", "-m", *BASE, "training.steps=1",
         "training.local_batch_size=1", "model.fail_on_rank=-1,0", "model.fail_user_error=true",
         f"hydra.sweep.dir={sweep}"],
        env=env, capture_output=True, text=True, timeout=TIMEOUT,
    )
    assert proc.returncode == 1, proc.stderr
    assert "2 jobs, 1 failed" in proc.stdout
    table = proc.stdout.split("failed\n", 1)[1]
    assert "failed: tiny: injected user error on rank 0" in table and " ok" in table
    assert proc.stderr.count("error: tiny: injected user error on rank 0") == 1


def _external_rank_env(tmp_path, name):
    from titan_plugins.train.api import rank_env

    env = {**os.environ, **rank_env(EXTRA), "TITAN_RUN_DIR": str(tmp_path / name), "OMP_NUM_THREADS": "1"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return env


TRAIN_2 = [*BASE, "parallelism=fsdp2", "training.steps=2", "training.local_batch_size=1"]


@pytest.fixture(scope="module")
def fsdp2_ref(tmp_path_factory):
    """TRAIN_2 launched by titan-run's own elastic launcher."""
    return _run(tmp_path_factory.mktemp("fsdp2_ref"), "ref", *TRAIN_2[len(BASE):])


def test_under_torchrun_each_process_trains_as_its_rank(tmp_path, fsdp2_ref):
    # torchrun starts the ranks; titan-run must not launch ranks of its own.
    ref = fsdp2_ref
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "titan_plugins.cli.run", *TRAIN_2]
    proc = subprocess.run(cmd, env=_external_rank_env(tmp_path, "torchrun"), capture_output=True, text=True,
                          timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    from titan_plugins.train.api import read_result

    got = read_result(tmp_path / "torchrun")
    assert got.steps == [1, 2]
    assert got.losses == ref.losses  # same ranks, same seed, same arithmetic: bit for bit
    assert (tmp_path / "torchrun" / "config.yaml").is_file()
    import json

    launch = json.loads((tmp_path / "torchrun" / "result.json").read_text())["launch"]  # by rank 0
    assert launch["by"] == "torchrun" and launch["world_size"] == 2


def test_slurm_tasks_become_ranks(tmp_path, fsdp2_ref):
    # What srun (and hydra-submitit-launcher's tasks) hand each process: SLURM_* only.
    from titan_plugins.distributed.launcher import free_port
    from titan_plugins.train.api import read_result

    ref = fsdp2_ref
    port = str(free_port())
    procs = []
    for task in range(2):
        env = _external_rank_env(tmp_path, "slurm")
        env.update(SLURM_NTASKS="2", SLURM_PROCID=str(task), SLURM_LOCALID=str(task), SLURM_JOB_ID="4242",
                   SLURM_STEP_ID="0", SLURM_LAUNCH_NODE_IPADDR="127.0.0.1", MASTER_PORT=port)
        procs.append(subprocess.Popen([sys.executable, "-m", "titan_plugins.cli.run", *TRAIN_2], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    try:
        outs = [p.communicate(timeout=TIMEOUT) for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], outs[0][1][-2000:] + outs[1][1][-2000:]
    got = read_result(tmp_path / "slurm")
    assert got.steps == [1, 2] and got.losses == ref.losses


@pytest.mark.skipif(
    not any(map(shutil.which, (os.environ.get("CXX", "g++"), "g++", "clang++", "c++"))),
    reason="torch.compile's CPU backend needs a C++ compiler",
)
@pytest.mark.extended  # ~2 min of inductor compile; compile under FSDP/TP vs eager
def test_compiled_blocks_train_like_eager_under_fsdp_and_tp(tmp_path):
    # Per-block torch.compile (inductor's C++ backend on CPU) composed with TP and FSDP2.
    from titan_plugins.compare.tolerances import LOSS_PARITY

    common = ["parallelism=fsdp2_tp2", "training.steps=2", "training.local_batch_size=1", "model.n_layers=2"]
    eager = _run(tmp_path, "eager", *common)
    cache = tmp_path / "inductor-cache"
    compiled = run([*BASE, *common, "training.compile=true"], run_dir=tmp_path / "compiled", extra_plugins=EXTRA,
                   timeout=TIMEOUT, env={"TORCHINDUCTOR_CACHE_DIR": str(cache)})
    assert compiled.returncode == 0, f"{compiled.error}\n{compiled.stderr[-3000:]}"
    assert any(cache.rglob("*.py")), "inductor wrote no kernels: the blocks were not compiled"
    assert compiled.losses == pytest.approx(eager.losses, rel=LOSS_PARITY.rtol, abs=LOSS_PARITY.atol)
