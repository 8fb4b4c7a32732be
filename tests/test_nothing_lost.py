"""Nothing of the user's is removed or replaced: titan-export's --out (titan_plugins/hf/out_dir.py),
the seed checkpoint's folder, checkpoint.export_hf's <run_dir>/hf; and every failure line,
a killed rank's included, has the same ``error:`` format."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest

from titan_plugins.errors import ConfigError
from titan_plugins.hf.out_dir import MARKER, claim_out_dir, export_kind, publish_dir, staging_dir


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A run directory with one DCP checkpoint of a one-layer qwen3, made in this process."""
    import torch
    import torch.distributed.checkpoint as dcp

    from titan_plugins.model.lifecycle import build_meta_model
    from titan_plugins.plugins import get_plugin_manager
    from titan_plugins.train.api import prepare_job, write_config

    run_dir = tmp_path_factory.mktemp("nothing-lost") / "run"
    spec, job, _ = prepare_job(["model=qwen3", "model.n_layers=1", "training.seq_len=16"],
                               get_plugin_manager(), run_dir=run_dir)
    write_config(job, run_dir)
    model = build_meta_model(spec, job)
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device("cpu"))
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"model": model.state_dict()}, checkpoint_id=str(run_dir / "checkpoints" / "step-1"))
    return run_dir


def _export(capsys, *argv: str) -> tuple[int, list[str]]:
    from titan_plugins.cli.export import main

    code = main(list(argv))
    return code, capsys.readouterr().err.strip().splitlines()


def _snapshot(folder: Path) -> dict[str, int]:
    return {str(p.relative_to(folder)): p.stat().st_size for p in sorted(folder.rglob("*"))}


def test_export_refuses_a_folder_it_did_not_write(run, tmp_path, capsys):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    code, err = _export(capsys, str(run), "--out", str(mine), "--overwrite")
    assert code == 2 and len(err) == 1 and err[0].startswith(f"error: --out {mine}: is not empty"), err
    assert (mine / "notes.txt").read_text() == "keep me" and len(list(mine.iterdir())) == 1


def test_export_never_removes_the_run_its_checkpoint_or_the_current_directory(run, tmp_path, capsys, monkeypatch):
    before = _snapshot(run)
    work = tmp_path / "work"
    work.mkdir()
    (work / "data.txt").write_text("x")
    monkeypatch.chdir(work)
    for out in (run, run.parent, run / "checkpoints" / "step-1", ".", "..", work):
        code, err = _export(capsys, str(run), "--out", str(out), "--overwrite")
        assert code == 2 and len(err) == 1 and err[0].startswith(f"error: --out {out}: is "), (out, err)
        assert "which an export never replaces" in err[0], err
    assert _snapshot(run) == before and (work / "data.txt").read_text() == "x"


def test_overwrite_replaces_only_an_earlier_export_of_the_same_kind(run, tmp_path, capsys):
    out = tmp_path / "exported"
    code, err = _export(capsys, str(run), "--out", str(out))
    assert code == 0 and export_kind(out) == "full", err
    assert (out / "config.json").is_file() and (out / "model.safetensors.index.json").is_file()
    (out / "stale.txt").write_text("from before")
    code, err = _export(capsys, str(run), "--out", str(out))
    assert code == 2 and err == [f"error: --out {out}: holds an earlier full export; pass --overwrite to replace it"]
    code, err = _export(capsys, str(run), "--out", str(out), "--overwrite")
    assert code == 0 and not (out / "stale.txt").exists() and export_kind(out) == "full", err
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging folder left
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / MARKER).write_text(json.dumps({"kind": "peft-adapter"}))
    (adapter / "adapter_model.safetensors").write_bytes(b"x")
    code, err = _export(capsys, str(run), "--out", str(adapter), "--overwrite")
    assert code == 2 and "holds a peft-adapter export, not a full one" in err[0], err
    assert (adapter / "adapter_model.safetensors").read_bytes() == b"x"


def test_publishing_alone_never_replaces_a_users_folder(tmp_path):
    out = tmp_path / "model"
    (tmp_path / "model.tmp").mkdir()  # a user's folder with the name the old code cleared
    (tmp_path / "model.tmp" / "keep").write_text("1")
    tmp = staging_dir(out)
    assert tmp.parent == tmp_path and tmp.name != "model.tmp" and not any(tmp.iterdir())
    out.mkdir()
    (out / "keep").write_text("2")
    with pytest.raises(ConfigError, match="not an earlier full export"):
        publish_dir(tmp, out, "full")
    assert (out / "keep").read_text() == "2" and (tmp_path / "model.tmp" / "keep").read_text() == "1"
    empty = tmp_path / "empty"
    empty.mkdir()
    claim_out_dir(empty, "merged")
    assert export_kind(publish_dir(staging_dir(empty), empty, "merged")) == "merged"
    with pytest.raises(ValueError):
        claim_out_dir(tmp_path / "new", "half")


def test_seed_checkpoint_replaces_only_an_earlier_checkpoint(tmp_path, monkeypatch):
    import torch

    from titan_plugins.checkpoint.checkpointer import save_model_weights
    from titan_plugins.plugins import get_plugin_manager
    from titan_plugins.train.api import prepare_job

    seed = tmp_path / "run" / "checkpoints" / "seed"
    seed.mkdir(parents=True)
    (seed / "mine.txt").write_text("keep")
    with pytest.raises(ConfigError, match="is not a DCP checkpoint; not replaced"):
        save_model_weights(torch.nn.Linear(2, 2), seed)
    monkeypatch.setenv("TITAN_PLUGINS_EXTRA", "tiny_plugin")
    with pytest.raises(ConfigError, match=r"^checkpoint.create_seed=true: .*seed exists and is not a DCP"):
        prepare_job(["model=tiny", "checkpoint.create_seed=true"], get_plugin_manager(strict=True),
                    run_dir=tmp_path / "run")
    assert (seed / "mine.txt").read_text() == "keep"


def test_export_hf_refuses_a_users_hf_folder_before_launch(tmp_path, monkeypatch):
    from titan_plugins.plugins import get_plugin_manager
    from titan_plugins.train.api import prepare_job

    (tmp_path / "run" / "hf").mkdir(parents=True)
    (tmp_path / "run" / "hf" / "mine.txt").write_text("keep")
    monkeypatch.setenv("TITAN_PLUGINS_EXTRA", "tiny_plugin")
    with pytest.raises(ConfigError, match=r"^checkpoint.export_hf=true: folder=.*hf: is not empty"):
        prepare_job(["model=tiny", "checkpoint.export_hf=true"], get_plugin_manager(strict=True),
                    run_dir=tmp_path / "run")


# ------------------------------------------------------------ one failure format
@pytest.mark.parametrize(("exitcode", "record", "expected"), [
    (-9, None, "error: rank 1 was killed by signal SIGKILL"),
    (3, None, "error: rank 1 exited with code 3"),
    (1, "user", "error: data.path='x' does not exist"),
    (1, "crash", "error: rank 1 crashed: RuntimeError: boom"),
])
def test_every_failure_line_has_the_error_prefix(tmp_path, monkeypatch, capsys, exitcode, record, expected):
    import torch.distributed.launcher.api as launcher_api
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from titan_plugins.distributed import launcher
    from titan_plugins.failures import FAILURE_DIR_ENV, record_failure

    def elastic_launch(config, entry):
        def start(*args):
            if record is not None:  # what the rank wrote before it failed
                monkeypatch.setenv("RANK", "1")
                record_failure(ConfigError("data.path='x' does not exist") if record == "user"
                               else RuntimeError("boom"))
            failure = ProcessFailure(local_rank=1, pid=101, exitcode=exitcode, error_file=str(tmp_path / "none"))
            raise ChildFailedError("entry", {1: failure})
        return start

    monkeypatch.setattr(launcher_api, "elastic_launch", elastic_launch)
    monkeypatch.delenv(FAILURE_DIR_ENV, raising=False)
    code = launcher._launch(SimpleNamespace(start_method="spawn"), print, tmp_path / "config.yaml",
                            tmp_path / "error.txt")
    err = capsys.readouterr().err.strip().splitlines()
    assert code != 0 and err[0] == expected, err
    assert (tmp_path / "error.txt").read_text().startswith(expected.removeprefix("error: "))


def test_tokenizer_trainer_and_eval_never_replace_a_users_file(tmp_path, capsys):
    from titan_plugins.cli.eval import main as eval_main
    from titan_plugins.data.train_tokenizer import main as tok_main

    mine = tmp_path / "tokenizer.json"
    mine.write_text("my own tokenizer")
    (tmp_path / "text.txt").write_text("some words to train on\n" * 50)
    assert tok_main([str(tmp_path / "text.txt"), "--out", str(mine)]) == 2
    assert "exists (pass --overwrite" in capsys.readouterr().err
    assert mine.read_text() == "my own tokenizer"

    results = tmp_path / "results.json"
    results.write_text("earlier results")
    assert eval_main(["--hf", str(tmp_path), "--model", "qwen3", "--tasks", "x",
                      "--tasks-dir", str(tmp_path), "--output", str(results)]) == 2
    assert "--output" in capsys.readouterr().err and results.read_text() == "earlier results"
