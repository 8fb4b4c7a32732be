"""Optional metric sinks for tools users already run: MLflow and Weights & Biases.

Each is a plugin object implementing the run hooks (``titan_on_train_start``,
``titan_on_step_end``, ``titan_on_validation_end``, ``titan_on_train_end``), registered
by ``titan_plugins.train.metrics.register_sinks`` like the console/JSONL/TensorBoard
sinks, and idle unless ``metrics.<sink>.enabled``. They act on rank 0 and import their
package only when enabled; the packages come with the extras ``titan-plugins[mlflow]``
and ``titan-plugins[wandb]``.
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING, Any

from titan_plugins.errors import ConfigError
from titan_plugins.train.sinks.naming import default_run_name, flat_params  # noqa: F401 - their old home

if TYPE_CHECKING:
    from omegaconf import DictConfig

__all__ = ["check_sinks", "default_run_name", "flat_params", "optional_sinks"]

# config key under metrics -> (importable module, extra)
_PACKAGES = {"mlflow": ("mlflow", "mlflow"), "wandb": ("wandb", "wandb")}


def check_sinks(job: DictConfig) -> None:
    """An enabled sink whose package is missing is one line before any rank starts."""
    for key, (module, extra) in _PACKAGES.items():
        cfg = job.metrics.get(key)
        if cfg is not None and cfg.enabled and importlib.util.find_spec(module) is None:
            raise ConfigError(
                f"metrics.{key}.enabled=true needs the {module} package "
                f"(pip install 'titan-plugins[{extra}]')"
            )


def optional_sinks() -> list[tuple[str, Any]]:
    """``(plugin name, sink object)`` for ``register_sinks``."""
    from titan_plugins.train.sinks.mlflow_sink import MLflowSink
    from titan_plugins.train.sinks.wandb_sink import WandbSink

    return [("titan.mlflow", MLflowSink()), ("titan.wandb", WandbSink())]
