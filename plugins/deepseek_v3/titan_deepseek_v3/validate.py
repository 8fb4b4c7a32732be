"""Model-specific checks against the parallel degrees, run before any worker starts.

Torch-free. ``parallelism`` is the job's ``parallelism`` node or a ``ParallelDims``
(anything with ``tp``, ``ep``, ``etp``, ``pp`` attributes).
"""

from __future__ import annotations

from typing import Any

from titan_deepseek_v3.config import DeepSeekV3Config
from titan_plugins.errors import ConfigError


def _divides(value: int, value_key: str, degree: int, degree_key: str) -> None:
    if degree > 1 and value % degree:
        raise ConfigError(f"{value_key}={value} is not divisible by {degree_key}={degree}")


def validate(config: DeepSeekV3Config, parallelism: Any) -> None:
    """Raise ``ConfigError`` with one line naming the two numbers that disagree."""
    config.validate()
    tp = int(getattr(parallelism, "tp", 1) or 1)
    ep = int(getattr(parallelism, "ep", 1) or 1)
    etp = int(getattr(parallelism, "etp", 1) or 1)
    pp = int(getattr(parallelism, "pp", 1) or 1)
    layer = config.layer
    _divides(layer.attention.n_heads, "model.layer.attention.n_heads", tp, "parallelism.tp")
    has_moe = config.n_dense_layers < config.n_layers
    if config.n_dense_layers > 0:
        _divides(layer.ffn.hidden_dim, "model.layer.ffn.hidden_dim", tp, "parallelism.tp")
    if has_moe:
        _divides(layer.moe.num_experts, "model.layer.moe.num_experts", ep, "parallelism.ep")
        # Routed experts are tensor-parallel when EP is off (tp) or with etp == tp.
        experts_tp = tp if ep == 1 else (etp if etp > 1 else 1)
        _divides(layer.moe.hidden_dim, "model.layer.moe.hidden_dim", experts_tp, "parallelism.tp")
        if layer.moe.num_shared_experts:
            _divides(layer.moe.hidden_dim * layer.moe.num_shared_experts,
                     "model.layer.moe.hidden_dim*num_shared_experts", tp, "parallelism.tp")
    elif ep > 1:
        raise ConfigError(
            f"parallelism.ep={ep} needs MoE layers, but model.n_dense_layers={config.n_dense_layers} "
            f"= model.n_layers={config.n_layers}"
        )
    if pp > 1 and config.n_layers < pp:
        raise ConfigError(f"model.n_layers={config.n_layers} is fewer than parallelism.pp={pp} stages")
