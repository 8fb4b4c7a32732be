"""Checks that run before any rank starts (titan_plugins/train/prelaunch.py): the data
source of every kind, every declared numeric range, model.hf's safetensors headers, an
MLflow URI the client cannot serve, and titan-run's --info searchpath."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest
from omegaconf import OmegaConf

from titan_plugins.errors import ConfigError


@pytest.fixture
def no_launch(monkeypatch, tmp_path):
    """titan-run in this process, with every way to start a rank failing the test."""
    import titan_plugins.distributed.launcher as launcher
    import titan_plugins.train.api as api

    def started(*args, **kwargs):
        raise AssertionError("a rank was started")

    monkeypatch.setattr(launcher, "launch", started)
    monkeypatch.setattr(api.subprocess, "Popen", started)
    monkeypatch.setenv("TITAN_PLUGINS_EXTRA", "tiny_plugin")
    monkeypatch.chdir(tmp_path)


def _jsonl(path):
    path.write_text("".join(json.dumps({"text": f"document {i} " * 20}) + "\n" for i in range(8)))
    return path


@pytest.mark.parametrize("case", ["text", "jsonl", "parquet", "hf", "mix-negative", "mix-all-zero",
                                  "mix-missing"])
def test_a_bad_data_source_is_refused_before_any_rank_starts(no_launch, tmp_path, capsys, case):
    from titan_plugins.cli.run import main

    good = _jsonl(tmp_path / "good.jsonl")
    nothing = tmp_path / "corpus" / "*.data"  # a glob that matches nothing
    if case.startswith("mix"):
        weights = {"mix-negative": (1, -1), "mix-all-zero": (0, 0), "mix-missing": (1, 1)}[case]
        second = nothing if case == "mix-missing" else good
        data = ["data.name=mix", f"data.mix=[{{name: jsonl, path: '{good}', weight: {weights[0]}}}, "
                                 f"{{name: jsonl, path: '{second}', weight: {weights[1]}}}]"]
        expected = "data.path" if case == "mix-missing" else "data.mix[0].weight=0" if case == "mix-all-zero" \
            else "data.mix[1].weight=-1"
    else:
        data = [f"data.name={case}", f"data.path='{nothing}'"]
        expected = "data.path"
    code = main(["model=tiny", "metrics.tensorboard=false", f"hydra.run.dir={tmp_path / 'run'}", *data])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("error: ") and expected in err[0], err


def test_a_readable_mix_passes_the_check(monkeypatch, tmp_path):
    from titan_plugins.plugins import get_plugin_manager
    from titan_plugins.train.api import prepare_job

    monkeypatch.setenv("TITAN_PLUGINS_EXTRA", "tiny_plugin")
    good = _jsonl(tmp_path / "good.jsonl")
    prepare_job(["model=tiny", "data.name=mix",
                 f"data.mix=[{{name: jsonl, path: '{good}', weight: 1}}, {{name: text, path: '{good}', weight: 2}}]"],
                get_plugin_manager(strict=True))


def test_every_file_source_declares_its_check():
    from titan_plugins.data.builtin import DATASETS
    from titan_plugins.spec import resolve

    checks = {spec.name: spec.check for spec in DATASETS}
    for name in ("text", "jsonl", "parquet", "hf", "mix"):
        assert checks[name] is not None and callable(resolve(checks[name])), name


# ------------------------------------------------------------------ ranges
def _job(**values):
    from titan_plugins.config.schema import JobConfig

    job = OmegaConf.structured(JobConfig)
    for key, value in values.items():
        OmegaConf.update(job, key, value)
    return job


def _outside(interval: str) -> float:
    from titan_plugins.train.prelaunch import _interval

    lo, hi, lo_in, _ = _interval(interval)
    return lo - 1 if lo_in else lo


def test_every_declared_range_is_checked_and_the_defaults_are_inside():
    from titan_plugins.train.prelaunch import check_ranges, declared_ranges

    ranges = declared_ranges()
    for key in ("checkpoint.interval", "training.lr", "training.beta1", "validation.every", "data.num_workers"):
        assert key in ranges, key
    check_ranges(_job())  # the defaults
    for key, interval in ranges.items():
        value = int(_outside(interval))  # every bound is a whole number; a float field takes it too
        with pytest.raises(ConfigError, match=rf"^{key}={value}(\.0)? must be") as info:
            check_ranges(_job(**{key: value}))
        assert "\n" not in str(info.value)


@pytest.mark.parametrize("value", [0, -1])
def test_checkpoint_interval_must_be_positive_before_launch(no_launch, capsys, tmp_path, value):
    from titan_plugins.cli.run import main

    code = main(["model=tiny", "checkpoint=periodic", f"checkpoint.interval={value}",
                 f"hydra.run.dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err == [f"error: checkpoint.interval={value} must be at least 1"], err


# ------------------------------------------------------------------ model.hf
def _safetensors(folder):
    import torch
    from safetensors.torch import save_file

    folder.mkdir()
    save_file({"a": torch.zeros(4, 4), "b": torch.ones(8)}, str(folder / "model.safetensors"))
    return folder / "model.safetensors"


def test_truncated_or_garbage_safetensors_are_named_before_launch(tmp_path):
    from titan_plugins.train.prelaunch import check_hf_weights, check_job

    good = _safetensors(tmp_path / "good")
    check_hf_weights(good.parent)
    data = good.read_bytes()
    cases = {"cut": data[:-10], "head": data[:20], "garbage": b"\x00\x01not a model at all" * 50, "tiny": b"abc"}
    for name, content in cases.items():
        folder = tmp_path / name
        folder.mkdir()
        (folder / "model-00001-of-00001.safetensors").write_bytes(content)
        with pytest.raises(ConfigError) as info:
            check_job(_hf_job(folder), None)
        text = str(info.value)
        assert text.startswith(f"model.hf={folder}: model-00001-of-00001.safetensors ") and "\n" not in text, text
    index = tmp_path / "index"
    index.mkdir()
    (index / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "gone.safetensors"}}))
    with pytest.raises(ConfigError, match="gone.safetensors .* is missing"):
        check_hf_weights(index)


def _hf_job(folder):
    job = _job(**{"data.name": "synthetic"})
    OmegaConf.set_struct(job, False)
    job.model = {"name": "tiny", "hf": str(folder)}
    return job


# ------------------------------------------------------------------ MLflow
@pytest.mark.skipif(importlib.util.find_spec("mlflow") is None, reason="the mlflow extra is not installed")
@pytest.mark.skipif(importlib.util.find_spec("sqlalchemy") is not None, reason="this client serves databases")
def test_an_mlflow_uri_the_client_cannot_serve_is_refused(tmp_path, monkeypatch):
    from titan_plugins.train.prelaunch import check_mlflow_uri

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    for uri in (f"sqlite:///{tmp_path}/runs.db", "postgresql://user@host/db"):
        with pytest.raises(ConfigError, match=rf"^metrics.mlflow.tracking_uri={uri}: the installed MLflow"):
            check_mlflow_uri(_job(**{"metrics.mlflow.enabled": True, "metrics.mlflow.tracking_uri": uri}))
    assert not list(tmp_path.iterdir())  # nothing created by the check
    for uri in (tmp_path.as_uri(), "http://localhost:5000", str(tmp_path)):
        check_mlflow_uri(_job(**{"metrics.mlflow.enabled": True, "metrics.mlflow.tracking_uri": uri}))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:///x.db")
    with pytest.raises(ConfigError, match=r"^MLFLOW_TRACKING_URI=sqlite:///x.db: "):
        check_mlflow_uri(_job(**{"metrics.mlflow.enabled": True}))
    check_mlflow_uri(_job())  # disabled: not looked at


# ------------------------------------------------------------------ --info
def test_info_searchpath_prints_the_search_path_and_exits_0(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "titan_plugins.cli.run", "--info", "searchpath"],
                          capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr + proc.stdout, proc.stderr[-2000:]
    assert "pkg://titan_plugins.conf" in proc.stdout
    assert not (tmp_path / "outputs").exists()


def test_info_of_a_composed_job_without_a_model_is_one_line(monkeypatch, capsys):
    from titan_plugins.cli.run import main

    monkeypatch.setenv("TITAN_PLUGINS_EXTRA", "tiny_plugin")
    assert main(["--info", "config"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --info config shows a composed job: give model=NAME"), err
