"""Checks a decoder plugin's ``validate(config, parallelism)`` shares: degrees against the
model, each ending in one ``ConfigError`` line that names the two numbers.

Torch-free (``validate`` runs in the outer process before any rank starts).
``parallelism`` is a ``ParallelismConfig``, a DictConfig node or a ``ParallelDims``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from titan_plugins.components.attention import AttentionBackend
from titan_plugins.errors import ConfigError

__all__ = ["check_attention_backend", "check_divisible", "check_pipeline", "degree"]


def degree(parallelism: Any, key: str, default: Any = 1) -> Any:
    """``parallelism.<key>`` (a mapping or an object), ``default`` when absent or None."""
    value = parallelism.get(key, default) if hasattr(parallelism, "get") else getattr(parallelism, key, default)
    return default if value is None else value


def check_divisible(sizes: Iterable[tuple[str, int]], tp: int) -> None:
    """Each ``(key, size)`` (``model.<key>``) must divide by ``parallelism.tp``."""
    for key, value in sizes:
        if value % tp:
            raise ConfigError(f"model.{key}={value} is not divisible by parallelism.tp={tp}")


def check_pipeline(parallelism: Any, *, n_layers: int, tied: bool = False) -> None:
    """Pipeline stages against the model: tied embeddings cannot be split across stages,
    and every stage (``pp x pp_stages_per_rank``) needs a layer."""
    pp = int(degree(parallelism, "pp"))
    stages = pp * int(degree(parallelism, "pp_stages_per_rank"))
    if pp > 1 and tied:
        raise ConfigError(
            f"model.enable_weight_tying=true cannot run with parallelism.pp={pp}: the tied "
            "embedding and output weight would live on different pipeline stages "
            "(use an untied flavor or set model.enable_weight_tying=false)"
        )
    if stages > 1 and n_layers < stages:
        raise ConfigError(
            f"model.n_layers={n_layers} is fewer than the {stages} pipeline stages "
            f"(parallelism.pp={pp} x pp_stages_per_rank)"
        )


def check_attention_backend(backend: AttentionBackend, parallelism: Any) -> None:
    """Flex attention has no CPU backward: refuse ``flex`` on ``device=cpu``."""
    if backend is AttentionBackend.flex and degree(parallelism, "device", "auto") == "cpu":
        raise ConfigError(
            "model.attn_backend=flex cannot train with parallelism.device=cpu: flex attention "
            "has no CPU backward (use attn_backend=auto or sdpa)"
        )
