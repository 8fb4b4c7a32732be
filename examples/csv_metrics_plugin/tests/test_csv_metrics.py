"""The CSV sink: hooks called directly (fast), then inside a real training run."""

from __future__ import annotations

import csv
import os
import subprocess
import sys

import pytest
from titan_csv_metrics import plugin


def _rows(path):
    with open(path, newline="") as handle:
        return list(csv.DictReader(handle))


def test_rank0_writes_one_row_per_step(tmp_path):
    plugin.titan_on_train_start(job_config=None, run_dir=str(tmp_path), rank=0)
    for step in (1, 2):
        metrics = {"loss": 10.0 / step, "grad_norm": 1.5, "lr": 1e-3}
        plugin.titan_on_step_end(step=step, metrics=metrics, job_config=None, rank=0)
        plugin.titan_on_step_end(step=step, metrics=metrics, job_config=None, rank=1)  # ignored
    plugin.titan_on_train_end(step=2, metrics={}, job_config=None, rank=0)
    rows = _rows(tmp_path / "metrics.csv")
    assert [r["step"] for r in rows] == ["1", "2"]
    assert list(rows[0]) == ["step", "loss", "grad_norm", "lr"]
    assert float(rows[1]["loss"]) == 5.0


def test_a_resumed_run_appends_under_the_same_header(tmp_path):
    for steps in ((1, 2), (3,)):
        plugin.titan_on_train_start(job_config=None, run_dir=str(tmp_path), rank=0)
        for step in steps:
            extra = {"new_metric": 1.0} if step == 3 else {}
            plugin.titan_on_step_end(step=step, metrics={"loss": 1.0, **extra}, job_config=None, rank=0)
        plugin.titan_on_train_end(step=steps[-1], metrics={}, job_config=None, rank=0)
    rows = _rows(tmp_path / "metrics.csv")
    assert [r["step"] for r in rows] == ["1", "2", "3"]
    assert list(rows[0]) == ["step", "loss"]


def test_the_plugin_module_imports_without_torch():
    code = "import sys, titan_csv_metrics.plugin; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_it_is_listed_with_its_hooks():
    from titan_plugins.plugins import get_plugin_manager

    pm = get_plugin_manager()
    info = pm.infos.get("csv_metrics")
    if info is None:  # not installed: register the module as an extra plugin
        pm.load_modules(["titan_csv_metrics.plugin"])
        info = pm.infos["titan_csv_metrics.plugin"]
    assert info.error is None
    hooks = sorted(c.name for c in pm.get_hookcallers(info.plugin))
    assert hooks == ["titan_on_step_end", "titan_on_train_end", "titan_on_train_start"]


def test_a_training_run_writes_metrics_csv(tmp_path):
    from titan_plugins.plugins import get_plugin_manager
    from titan_plugins.train.api import run

    models = get_plugin_manager().models()
    name = next((m for m in ("gpt2", "qwen3", "llama4") if m in models), None)
    if name is None:
        pytest.skip("no model plugin installed to train")
    extra = [] if "csv_metrics" in get_plugin_manager().infos else ["titan_csv_metrics.plugin"]
    overrides = [f"model={name}", "model.n_layers=2", "training.steps=2", "training.seq_len=32",
                 "metrics.tensorboard=false"]
    result = run(overrides, run_dir=tmp_path, extra_plugins=extra, timeout=300,
                 env={"OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)})
    assert result.returncode == 0, result.error
    rows = _rows(tmp_path / "metrics.csv")
    assert [int(r["step"]) for r in rows] == [1, 2]
    assert [round(float(r["loss"]), 5) for r in rows] == [round(x, 5) for x in result.losses]
