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
from pathlib import Path
from typing import TYPE_CHECKING, Any

from titan_plugins.errors import ConfigError

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


def default_run_name(job: DictConfig, run_dir: str) -> str:
    """``<model>-<flavor>-<run dir name>``: tells runs apart in a tracker's list."""
    flavor = job.model.get("flavor") or "default"
    return f"{job.model.name}-{flavor}-{Path(run_dir).name}"


def flat_params(job: DictConfig) -> dict[str, Any]:
    """The resolved job as ``{"training.lr": 0.003, ...}`` (trackers take flat params)."""
    from omegaconf import OmegaConf

    out: dict[str, Any] = {}

    def walk(prefix: str, node: Any) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        else:
            out[prefix] = getattr(node, "value", node)  # Enum members as their value

    walk("", OmegaConf.to_container(job, resolve=True, enum_to_str=True))
    return out
