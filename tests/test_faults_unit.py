"""In-process checks of the fault handling: run-directory claims and locks, the
launcher's choice of the first failure, checkpoint manifests, pre-launch checks."""

from __future__ import annotations

import errno
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from titan_plugins.errors import ConfigError


def test_two_jobs_started_together_claim_two_directories(tmp_path):
    from titan_plugins import run_dir

    base = str(tmp_path / "outputs" / "2026-01-01" / "12-00-00")
    code = f"from titan_plugins.run_dir import claim; print(claim({base!r}))"
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True) for _ in range(3)]
    claimed = [p.communicate()[0].strip() for p in procs]
    assert len(set(claimed)) == 3 and all(Path(c).is_dir() for c in claimed)
    run_dir.forget_claims()
    assert run_dir.claim(base) not in claimed  # a fourth job: yet another one
    assert run_dir.claim(base) == run_dir.claim(base)  # Hydra resolving again: the same claim
    run_dir.forget_claims()


def test_default_hydra_run_dir_is_claimed(tmp_path, monkeypatch):
    from omegaconf import OmegaConf

    from titan_plugins.config.hydra_glue import compose
    from titan_plugins.plugins import get_plugin_manager
    from titan_plugins.run_dir import forget_claims

    monkeypatch.chdir(tmp_path)
    pm = get_plugin_manager()
    model = sorted(pm.models())[0]
    dirs = []
    for _ in range(2):
        forget_claims()
        cfg = compose([f"model={model}"], pm, return_hydra_config=True)
        dirs.append(OmegaConf.select(cfg, "hydra.run.dir"))
    forget_claims()
    assert dirs[0] != dirs[1] and all(Path(d).is_dir() for d in dirs)


def test_a_live_job_owns_its_run_directory(tmp_path):
    from titan_plugins.run_dir import hold

    with hold(tmp_path):
        with pytest.raises(ConfigError, match=r"in use by another live job \(pid \d+\)"):
            with hold(tmp_path):
                pass
    with hold(tmp_path):  # released with its holder
        pass


def test_unwritable_run_directory_is_one_line(tmp_path):
    from titan_plugins.run_dir import check_writable

    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match=r"^hydra.run.dir=.*file/run: the run directory is not writable"):
        check_writable(tmp_path / "file" / "run")


def test_a_rank_killed_by_a_signal_is_named_before_its_peers_records(tmp_path, monkeypatch):
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from titan_plugins.failures import (
        FAILURE_DIR_ENV,
        first_failure,
        read_failure_records,
        record_failure,
    )

    monkeypatch.setenv(FAILURE_DIR_ENV, str(tmp_path))
    monkeypatch.setenv("RANK", "0")
    record_failure(RuntimeError("[gloo/transport/tcp/pair.cc] Connection reset by peer"))
    failures = {0: ProcessFailure(local_rank=0, pid=100, exitcode=1, error_file=str(tmp_path / "none.json")),
                1: ProcessFailure(local_rank=1, pid=101, exitcode=-15, error_file=str(tmp_path / "none.json"))}
    rank, text, user, code = first_failure(ChildFailedError("entry", failures), read_failure_records(tmp_path))
    assert (rank, text, code) == (1, "rank 1 was killed by signal SIGTERM", 143)


def test_ctrl_c_in_a_rank_is_recorded_as_one_line(tmp_path, monkeypatch):
    from titan_plugins.failures import (
        FAILURE_DIR_ENV,
        INTERRUPTED,
        read_failure_records,
        record_failure,
    )

    monkeypatch.setenv(FAILURE_DIR_ENV, str(tmp_path))
    monkeypatch.setenv("RANK", "1")
    record_failure(KeyboardInterrupt())
    assert read_failure_records(tmp_path)[1]["message"]["message"] == INTERRUPTED


def _fake_checkpoint(path: Path, files: dict[str, bytes]) -> None:
    from titan_plugins.checkpoint.checkpointer import write_manifest

    path.mkdir(parents=True)
    for name, data in files.items():
        (path / name).write_bytes(data)
    write_manifest(path)


def test_manifest_names_what_is_damaged(tmp_path):
    from titan_plugins.checkpoint.checkpointer import MANIFEST, verify_checkpoint

    _fake_checkpoint(tmp_path / "ok", {".metadata": b"m" * 10, "__0_0.distcp": b"x" * 100})
    assert verify_checkpoint(tmp_path / "ok") is None
    assert json.loads((tmp_path / "ok" / MANIFEST).read_text())["files"]["__0_0.distcp"] == 100
    (tmp_path / "ok" / "__0_0.distcp").write_bytes(b"x" * 40)
    assert verify_checkpoint(tmp_path / "ok") == "__0_0.distcp has 40 of 100 bytes"
    (tmp_path / "ok" / "__0_0.distcp").unlink()
    assert verify_checkpoint(tmp_path / "ok") == "__0_0.distcp is missing"
    (tmp_path / "ok" / MANIFEST).write_text("{")
    assert verify_checkpoint(tmp_path / "ok") == "manifest.json is damaged"


def test_no_usable_checkpoint_is_one_error_line(tmp_path):
    from titan_plugins.checkpoint.checkpointer import Checkpointer, CheckpointError

    folder = tmp_path / "ckpt"
    for step in (2, 4):
        _fake_checkpoint(folder / f"step-{step}", {".metadata": b"m" * 10})
        (folder / f"step-{step}" / ".metadata").write_bytes(b"m")
    cfg = SimpleNamespace(folder=str(folder), enabled=True, interval=2, keep_last=2, resume=True, save_final=True)
    ckpt = Checkpointer(SimpleNamespace(checkpoint=cfg), tmp_path, [], [], [], None)
    with pytest.raises(CheckpointError) as info:
        ckpt.maybe_resume()
    assert str(info.value).startswith(f"no usable checkpoint in {folder} (step-4: .metadata has 1 of 10 bytes; "
                                      "step-2: .metadata has 1 of 10 bytes)")
    assert "\n" not in str(info.value)


def test_enospc_is_found_inside_dcp_failures():
    from torch.distributed.checkpoint.api import CheckpointException

    from titan_plugins.checkpoint.checkpointer import _is_enospc

    full = OSError(errno.ENOSPC, "No space left on device")
    assert _is_enospc(CheckpointException("save", {1: (full, None)}))
    assert not _is_enospc(CheckpointException("save", {1: (ValueError("bad"), None)}))


@pytest.mark.parametrize(("override", "message"), [
    ("training.lr=-1", "training.lr=-1.0 must be positive"),
    ("training.beta1=1.0", "training.beta1=1.0 must be in [0, 1)"),
    ("training.seq_len=100000", "training.seq_len=100000 is above the model's max_seq_len="),
])
def test_out_of_range_values_stop_before_launch(override, message):
    from titan_plugins.plugins import get_plugin_manager
    from titan_plugins.train.api import _patched_env, prepare_job, rank_env

    with _patched_env(rank_env(["tiny_plugin"])):
        pm = get_plugin_manager(strict=True)
        with pytest.raises(ConfigError) as info:
            prepare_job(["model=tiny", override], pm)
    assert str(info.value).startswith(message)


def test_nonfinite_skip_counts_and_stops_after_max_skips_in_a_row(capsys):
    import torch

    from titan_plugins.train.nonfinite import NonFiniteError, NonFiniteGuard

    guard = NonFiniteGuard("skip", 2, rank=0, world=1, device=torch.device("cpu"))
    ok, nan = torch.tensor(1.0), torch.tensor(float("nan"))
    assert guard.check(1, ok, ok) is False
    assert guard.check(2, nan, ok) is True and guard.check(3, ok, torch.tensor(float("inf"))) is True
    assert guard.check(4, ok, ok) is False  # the count in a row starts again
    assert guard.check(5, nan, ok) is True
    assert guard.summary() == "3 skipped (steps 2, 3, 5)"
    with pytest.raises(NonFiniteError, match=r"^step 7: the loss is not finite on rank 0, 3 steps in a row; "
                                             r"training.nonfinite_max_skips=2 ended the run"):
        guard.check(6, nan, ok)
        guard.check(7, nan, ok)
    stop = NonFiniteGuard("stop", 5, rank=0, world=1, device=torch.device("cpu"))
    with pytest.raises(NonFiniteError, match=r"^step 9: the gradient norm is not finite"):
        stop.check(9, ok, nan)
    assert "warning: step 2: the loss is not finite on rank 0: optimizer step skipped" in capsys.readouterr().out


def test_on_signal_needs_checkpoints_before_launch():
    from titan_plugins.plugins import get_plugin_manager
    from titan_plugins.train.api import _patched_env, prepare_job, rank_env

    with _patched_env(rank_env(["tiny_plugin"])):
        pm = get_plugin_manager(strict=True)
        with pytest.raises(ConfigError, match=r"^checkpoint.on_signal=USR1 needs checkpoints"):
            prepare_job(["model=tiny", "checkpoint.on_signal=USR1"], pm)
        with pytest.raises(ConfigError, match="training.nonfinite"):
            prepare_job(["model=tiny", "training.nonfinite=sometimes"], pm)
