"""Checks of a job that need no rank: values out of range and data sources that
cannot be read end with one line naming the key and the value, before any rank
starts (``titan_plugins.train.api.validate_job`` calls ``check_job``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from titan_plugins.errors import ConfigError

if TYPE_CHECKING:
    from omegaconf import DictConfig

__all__ = ["check_job"]

# key: (test, what the value must be)
_TRAINING_RANGES = {
    "lr": (lambda v: v > 0, "must be positive"),
    "min_lr_ratio": (lambda v: 0 <= v <= 1, "must be in [0, 1]"),
    "warmup_steps": (lambda v: v >= 0, "must be at least 0"),
    "weight_decay": (lambda v: v >= 0, "must be at least 0"),
    "beta1": (lambda v: 0 <= v < 1, "must be in [0, 1)"),
    "beta2": (lambda v: 0 <= v < 1, "must be in [0, 1)"),
    "eps": (lambda v: v > 0, "must be positive"),
    "max_norm": (lambda v: v > 0, "must be positive"),
}


def check_job(job: DictConfig, model_config: Any) -> None:
    """Optimizer and schedule values in range, ``training.seq_len`` within the model's
    ``max_seq_len`` (where it has one), the data source readable."""
    training = job.training
    for key, (ok, rule) in _TRAINING_RANGES.items():
        value = training.get(key)
        if value is not None and not ok(float(value)):
            raise ConfigError(f"training.{key}={value} {rule}")
    max_len = getattr(model_config, "max_seq_len", None)
    if isinstance(max_len, int) and int(training.seq_len) > max_len:
        raise ConfigError(
            f"training.seq_len={training.seq_len} is above the model's max_seq_len={max_len} "
            "(lower training.seq_len or raise model.max_seq_len)"
        )
    check = _data_source_check()
    if check is not None:
        check(job.data)
    from titan_plugins.train.profiling import check_profiling
    from titan_plugins.train.sinks import check_sinks

    check_sinks(job)  # an enabled MLflow/W&B sink needs its package
    check_profiling(job)
    from titan_plugins.distributed.float8 import check_float8

    check_float8(job)  # no CUDA / SM < 8.9 / no torchao: one line before launch


def _data_source_check() -> Any:
    """The data package's ``check_data_source(data_cfg)`` (raises ``ConfigError``)."""
    import importlib

    for module in ("titan_plugins.train.data.sources", "titan_plugins.train.data"):
        try:
            check = getattr(importlib.import_module(module), "check_data_source", None)
        except (ImportError, AttributeError):
            continue
        if check is not None:
            return check
    return None  # not offered (yet): the ranks report a bad source as before
