"""A crashed run closes its tracker runs as failed, keeping what was logged
(``titan_on_train_error`` in the MLflow and W&B sinks)."""

from __future__ import annotations

import os
import time

import pytest
from omegaconf import OmegaConf

from titan_plugins.testing.wandb_log import wandb_records
from titan_plugins.train.sinks.mlflow_sink import MLflowSink
from titan_plugins.train.sinks.wandb_sink import WandbSink


def _job(tmp_path):
    return OmegaConf.create({
        "model": {"name": "tiny", "flavor": "debugmodel"},
        "training": {"steps": 5},
        "metrics": {
            "mlflow": {"enabled": True, "tracking_uri": (tmp_path / "mlruns").as_uri(),
                       "experiment": "crash", "run_name": None},
            "wandb": {"enabled": True, "project": "crash", "entity": None, "mode": "offline",
                      "dir": str(tmp_path), "run_name": None},
        },
    })


def test_mlflow_run_of_a_crashed_training_is_failed_with_its_history(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    from mlflow import MlflowClient

    job, sink = _job(tmp_path), MLflowSink()
    sink.titan_on_train_start(job_config=job, run_dir=str(tmp_path / "run"), rank=0)
    for step in (1, 2):
        sink.titan_on_step_end(step=step, metrics={"loss": 3.0 - step}, job_config=job, rank=0)
    sink.titan_on_train_error(step=2, error="RuntimeError: boom", rank=0)

    client = MlflowClient(tracking_uri=job.metrics.mlflow.tracking_uri)
    (run,) = client.search_runs([client.get_experiment_by_name("crash").experiment_id])
    assert run.info.status == "FAILED"
    assert run.data.tags["titan.error"] == "RuntimeError: boom"
    history = client.get_metric_history(run.info.run_id, "train/loss")
    assert [(m.step, m.value) for m in history] == [(1, 2.0), (2, 1.0)]


@pytest.mark.slow  # wandb starts its service process (a few seconds)
def test_wandb_offline_run_of_a_crashed_training_keeps_history_and_exit_code(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    job, sink = _job(tmp_path), WandbSink()
    sink.titan_on_train_start(job_config=job, run_dir=str(tmp_path / "run"), rank=0)
    for step in (1, 2):
        sink.titan_on_step_end(step=step, metrics={"loss": 3.0 - step}, job_config=job, rank=0)
    sink.titan_on_train_error(step=2, error="RuntimeError: boom", rank=0)

    (run_file,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    # wandb's service process writes the log; under load it can lag finish() by a moment
    # (seen once in a loaded suite run: the file still empty). Wait for its exit record.
    def read() -> list:
        return wandb_records(run_file) if run_file.stat().st_size >= 7 else []

    deadline = time.monotonic() + 30
    records = read()
    while not any(r.WhichOneof("record_type") == "exit" for r in records) and time.monotonic() < deadline:
        time.sleep(0.2)
        records = read()
    kinds = [r.WhichOneof("record_type") for r in records]
    exits = [r.exit for r in records if r.WhichOneof("record_type") == "exit"]
    assert kinds.count("history") == 2
    assert exits and exits[-1].exit_code == 1
    assert os.path.getsize(run_file) > 0
