"""The Weights & Biases sink (``metrics.wandb.enabled=true``; ``titan-plugins[wandb]``).

Rank 0 calls ``wandb.init`` with ``metrics.wandb.project``/``entity``/``mode`` (online,
or offline: written under ``<dir>/wandb/offline-run-*`` for a later ``wandb sync``),
the resolved job as the run config, and ``dir`` defaulting to the run directory; it logs
every step's metrics as ``train/<name>`` and each validation as ``validation/<name>``
at the training step, and finishes the run after the last step (with exit code 1 when the
training loop raises). ``WANDB_MODE`` in the
environment wins over ``mode``, as it does for every W&B script.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from titan_plugins.hookspecs import hookimpl
from titan_plugins.train.sinks.naming import default_run_name, flat_params

if TYPE_CHECKING:
    from omegaconf import DictConfig

__all__ = ["WandbSink"]


class WandbSink:
    def __init__(self) -> None:
        self._run: Any = None

    @hookimpl
    def titan_on_train_start(self, job_config: DictConfig, run_dir: str, rank: int) -> None:
        cfg = job_config.metrics.get("wandb")
        if rank != 0 or cfg is None or not cfg.enabled:
            return
        import wandb

        folder = cfg.dir or run_dir
        os.makedirs(folder, exist_ok=True)
        self._run = wandb.init(
            project=cfg.project,
            entity=cfg.entity,
            name=cfg.run_name or default_run_name(job_config, run_dir),
            mode=os.environ.get("WANDB_MODE") or str(getattr(cfg.mode, "value", cfg.mode)),
            dir=folder,
            config=flat_params(job_config),
        )

    @hookimpl
    def titan_on_step_end(self, step: int, metrics: dict[str, float], job_config: DictConfig, rank: int) -> None:
        if self._run is not None:
            self._run.log({f"train/{k}": float(v) for k, v in metrics.items()}, step=step)

    @hookimpl
    def titan_on_validation_end(self, step: int, metrics: dict[str, float], job_config: DictConfig, rank: int) -> None:
        if self._run is not None:
            # the same step as the step's metrics: W&B merges them into that row
            self._run.log({f"validation/{k}": float(v) for k, v in metrics.items()}, step=step)

    @hookimpl
    def titan_on_train_end(self, step: int, metrics: dict[str, float], job_config: DictConfig, rank: int) -> None:
        if self._run is not None:
            self._run.finish()
            self._run = None

    @hookimpl
    def titan_on_train_error(self, step: int, error: str, rank: int) -> None:
        # Finish with a non-zero exit code: the history so far is flushed and the run is
        # marked failed (an unfinished offline run would keep neither).
        if self._run is not None:
            self._run.summary["error"] = error[:5000]
            self._run.finish(exit_code=1)
            self._run = None

