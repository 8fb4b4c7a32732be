"""GPT-2 schema, flavors, validation and FLOP count (torch-free)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any

from titan_plugins.errors import ConfigError

__all__ = ["FLAVORS", "Activation", "GPT2Config", "flops", "validate"]


class Activation(str, Enum):
    """An Enum, not a Literal: OmegaConf types it and rejects other values."""

    gelu = "gelu"
    gelu_tanh = "gelu_tanh"  # GPT-2's approximation


@dataclass(kw_only=True)
class GPT2Config:
    dim: int = 768
    n_layers: int = 12
    n_heads: int = 12
    vocab_size: int = 50257
    max_seq_len: int = 1024  # rows of the learned position table
    mlp_ratio: int = 4
    norm_eps: float = 1e-5
    activation: Activation = Activation.gelu_tanh

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


FLAVORS = {
    "debugmodel": GPT2Config(dim=64, n_layers=4, n_heads=4, vocab_size=2048, max_seq_len=256),
    "124M": GPT2Config(),
    "350M": GPT2Config(dim=1024, n_layers=24, n_heads=16),
}


def validate(config: GPT2Config, parallelism: Any) -> None:
    if config.dim % config.n_heads:
        raise ConfigError(f"model.dim={config.dim} is not divisible by model.n_heads={config.n_heads}")
    if config.n_heads % int(parallelism.tp):
        raise ConfigError(f"model.n_heads={config.n_heads} is not divisible by parallelism.tp={parallelism.tp}")


def flops(config: GPT2Config, seq_len: int) -> tuple[int, int]:
    c = config
    per_layer = 4 * c.dim * c.dim + 2 * c.mlp_ratio * c.dim * c.dim + 9 * c.dim + c.mlp_ratio * c.dim
    params = c.n_layers * per_layer + (2 * c.vocab_size + c.max_seq_len) * c.dim + 2 * c.dim
    dense = params - (c.vocab_size + c.max_seq_len) * c.dim  # embeddings are lookups
    return params, 6 * dense + 12 * c.n_layers * c.dim * seq_len
