"""The MLflow sink (``metrics.mlflow.enabled=true``; ``titan-plugins[mlflow]``).

Rank 0 starts a run in ``metrics.mlflow.experiment`` named ``metrics.mlflow.run_name``,
logs the resolved job as params, every step's metrics as ``train/<name>`` and each
validation as ``validation/<name>`` at its step, and ends the run after the last step (``FAILED``, with the error as the
``titan.error`` tag, when the training loop raises).
The tracking URI is ``metrics.mlflow.tracking_uri``, else ``$MLFLOW_TRACKING_URI``,
else a file store in ``<run_dir>/mlruns`` (``mlflow ui --backend-store-uri <it>``).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from titan_plugins.hookspecs import hookimpl
from titan_plugins.train.sinks.naming import default_run_name, flat_params

if TYPE_CHECKING:
    from omegaconf import DictConfig

__all__ = ["MLflowSink", "tracking_uri"]


def tracking_uri(cfg: Any, run_dir: str) -> str:
    return cfg.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or (Path(run_dir) / "mlruns").resolve().as_uri()


class MLflowSink:
    def __init__(self) -> None:
        self._client: Any = None
        self._run_id: str | None = None

    @hookimpl
    def titan_on_train_start(self, job_config: DictConfig, run_dir: str, rank: int) -> None:
        cfg = job_config.metrics.get("mlflow")
        if rank != 0 or cfg is None or not cfg.enabled:
            return
        uri = tracking_uri(cfg, run_dir)
        if uri.startswith("file:"):
            # MLflow 3 keeps its file store only for those who opt in; a local run
            # directory needs no server or database.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow import MlflowClient
        from mlflow.entities import Param

        client = MlflowClient(tracking_uri=uri)
        experiment = client.get_experiment_by_name(cfg.experiment)
        exp_id = experiment.experiment_id if experiment else client.create_experiment(cfg.experiment)
        run = client.create_run(exp_id, run_name=cfg.run_name or default_run_name(job_config, run_dir))
        # MLflow refuses a param value over 6000 characters (a long data.mix list could be)
        params = [Param(k, str(v)[:6000]) for k, v in flat_params(job_config).items()]
        for i in range(0, len(params), 100):  # MLflow takes at most 100 params per batch
            client.log_batch(run.info.run_id, params=params[i:i + 100])
        self._client, self._run_id = client, run.info.run_id

    def _log(self, prefix: str, step: int, metrics: dict[str, float]) -> None:
        from mlflow.entities import Metric

        ts = int(time.time() * 1000)
        batch = [Metric(f"{prefix}/{k}", float(v), ts, step) for k, v in metrics.items()]
        self._client.log_batch(self._run_id, metrics=batch)

    @hookimpl
    def titan_on_step_end(self, step: int, metrics: dict[str, float], job_config: DictConfig, rank: int) -> None:
        if self._run_id is not None:
            self._log("train", step, metrics)

    @hookimpl
    def titan_on_validation_end(self, step: int, metrics: dict[str, float], job_config: DictConfig, rank: int) -> None:
        if self._run_id is not None:
            self._log("validation", step, metrics)

    @hookimpl
    def titan_on_train_end(self, step: int, metrics: dict[str, float], job_config: DictConfig, rank: int) -> None:
        if self._run_id is not None:
            self._client.set_terminated(self._run_id, status="FINISHED")
            self._client, self._run_id = None, None

    @hookimpl
    def titan_on_train_error(self, step: int, error: str, rank: int) -> None:
        # A crashed run must not stay RUNNING: what was logged stays, the status says FAILED.
        if self._run_id is not None:
            self._client.set_tag(self._run_id, "titan.error", error[:5000])
            self._client.set_terminated(self._run_id, status="FAILED")
            self._client, self._run_id = None, None

