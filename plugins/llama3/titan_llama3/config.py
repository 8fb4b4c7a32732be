"""Llama 3 config schema, named flavors, parameter counts and validation.

Torch-free: the plugin module and Hydra's config store import this. The numbers are
TorchTitan v0.2.2's (``torchtitan/models/llama3``: ``TransformerModelArgs`` and the
``llama3_args`` flavors) plus Llama 3.2 1B/3B (tied embeddings, RoPE factor 32).
The SwiGLU hidden size is derived as TorchTitan derives it (``4 * dim``, two thirds,
``ffn_dim_multiplier``, rounded up to ``multiple_of``) unless ``hidden_dim`` gives it
(Hugging Face's ``intermediate_size``); ``head_dim`` likewise defaults to ``dim // n_heads``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from titan_plugins.components import validation as checks
from titan_plugins.components.attention import AttentionBackend
from titan_plugins.components.attention_masks import AttentionMask
from titan_plugins.components.rope_config import RoPEScaling
from titan_plugins.errors import ConfigError

__all__ = [
    "FLAVORS",
    "AttentionBackend",
    "AttentionMask",
    "Llama3Config",
    "RoPEScaling",
    "flops",
    "num_params",
    "validate",
]


@dataclass(kw_only=True)
class Llama3Config:
    dim: int = 256
    n_layers: int = 6
    n_heads: int = 16
    n_kv_heads: int | None = None  # None: multi-head attention (= n_heads)
    head_dim: int | None = None  # None: dim // n_heads (TorchTitan); Hugging Face may give it
    vocab_size: int = 2048
    multiple_of: int = 256  # the SwiGLU hidden size rounds up to a multiple of this
    ffn_dim_multiplier: float | None = None
    hidden_dim: int | None = None  # explicit SwiGLU hidden size (wins over the derivation)
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    rope_scaling: RoPEScaling = field(default_factory=RoPEScaling)
    max_seq_len: int = 2048  # length of the rotary cache
    depth_init: bool = True  # init std of block i scales with i (else with n_layers)
    enable_weight_tying: bool = False  # output.weight is tok_embeddings.weight (Llama 3.2 1B/3B)
    attention_bias: bool = False  # biases on wq/wk/wv/wo (Hugging Face attention_bias)

    attn_backend: AttentionBackend = AttentionBackend.auto
    attn_mask: AttentionMask = AttentionMask.causal
    eos_id: int = 0  # document separator for block_causal (TorchTitan's default)

    @property
    def kv_heads(self) -> int:
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def head_size(self) -> int:
        return self.dim // self.n_heads if self.head_dim is None else self.head_dim

    @property
    def ffn_hidden_dim(self) -> int:
        """TorchTitan's ``FeedForward`` sizing, or ``hidden_dim`` when given."""
        if self.hidden_dim is not None:
            return self.hidden_dim
        hidden = int(2 * (4 * self.dim) / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * ((hidden + self.multiple_of - 1) // self.multiple_of)

    def check(self) -> None:
        """Model-only consistency; raises ConfigError naming the numbers."""
        for key in ("dim", "n_layers", "n_heads", "vocab_size", "multiple_of"):
            if getattr(self, key) < 1:
                raise ConfigError(f"model.{key}={getattr(self, key)} must be >= 1")
        for key in ("n_kv_heads", "head_dim", "hidden_dim"):
            value = getattr(self, key)
            if value is not None and value < 1:
                raise ConfigError(f"model.{key}={value} must be >= 1 (or null)")
        if self.n_heads % self.kv_heads:
            raise ConfigError(
                f"model.n_heads={self.n_heads} is not divisible by model.n_kv_heads={self.kv_heads}"
            )
        if self.head_dim is None and self.dim % self.n_heads:
            raise ConfigError(
                f"model.dim={self.dim} is not divisible by model.n_heads={self.n_heads} "
                "(set model.head_dim)"
            )
        if self.head_size % 2:
            raise ConfigError(f"head dim {self.head_size} must be even for RoPE (model.head_dim)")
        s = self.rope_scaling
        if s.enabled and s.high_freq_factor <= s.low_freq_factor:
            raise ConfigError(
                f"model.rope_scaling.high_freq_factor={s.high_freq_factor} must be above "
                f"model.rope_scaling.low_freq_factor={s.low_freq_factor}"
            )


def _llama(dim: int, n_layers: int, n_heads: int, multiplier: float, multiple_of: int,
           **extra: Any) -> Llama3Config:
    return Llama3Config(
        dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=8, vocab_size=128256,
        ffn_dim_multiplier=multiplier, multiple_of=multiple_of, max_seq_len=131072,
        eos_id=128001, **extra,  # <|end_of_text|>
    )


def _llama32(dim: int, n_layers: int, n_heads: int, multiplier: float) -> Llama3Config:
    """Llama 3.2 1B/3B: tied embeddings, RoPE factor 32 (Meta's params.json, HF config.json)."""
    return _llama(dim, n_layers, n_heads, multiplier, 256, enable_weight_tying=True,
                  rope_scaling=RoPEScaling(scaling_factor=32.0))



FLAVORS: dict[str, Llama3Config] = {
    # TorchTitan's debugmodel: dim 256, 6 layers, 16 heads (MHA), vocab 2048, theta 5e5,
    # its default (Llama 3.1) RoPE scaling.
    "debugmodel": Llama3Config(dim=256, n_layers=6, n_heads=16, vocab_size=2048, rope_theta=500000.0),
    "1B": _llama32(2048, 16, 32, 1.5),
    "3B": _llama32(3072, 28, 24, 1.0),
    "8B": _llama(4096, 32, 32, 1.3, 1024),
    "70B": _llama(8192, 80, 64, 1.3, 4096),
    "405B": _llama(16384, 126, 128, 1.2, 4096),
}


# ------------------------------------------------------------------- counting
def num_params(config: Llama3Config) -> int:
    """Unique parameters, embeddings included (a tied output weight counted once).
    ``build`` on meta gives the same number (a test checks it)."""
    c = config
    d, hd, h, kv = c.dim, c.head_size, c.n_heads, c.kv_heads
    attn = 2 * d * h * hd + 2 * d * kv * hd
    if c.attention_bias:
        attn += h * hd + 2 * kv * hd + d
    per_layer = attn + 3 * d * c.ffn_hidden_dim + 2 * d  # + attention_norm, ffn_norm
    embeddings = c.vocab_size * d * (1 if c.enable_weight_tying else 2)
    return embeddings + d + c.n_layers * per_layer


def flops(config: Llama3Config, seq_len: int) -> tuple[int, int]:
    """``(num_params, flops_per_token)``: TorchTitan's dense formula, 6 x the
    non-embedding parameters plus attention with q/k + v head dims = 2 * head_dim."""
    total = num_params(config)
    c = config
    attention = 6 * c.n_layers * c.n_heads * (2 * c.head_size) * seq_len
    return total, 6 * (total - c.vocab_size * c.dim) + attention


# ------------------------------------------------------------------ validation
def validate(config: Llama3Config, parallelism: Any) -> None:
    """Degrees against the model, before any worker starts; one line naming both
    numbers. ``parallelism`` is a ``ParallelismConfig``, a DictConfig or ParallelDims."""
    c = config
    c.check()
    tp = int(checks.degree(parallelism, "tp"))
    if int(checks.degree(parallelism, "ep")) > 1:
        raise ConfigError(f"parallelism.ep={checks.degree(parallelism, 'ep')} needs experts; llama3 is dense (use ep=1)")
    if tp > 1:
        checks.check_divisible((("n_heads", c.n_heads), ("n_kv_heads", c.kv_heads), ("vocab_size", c.vocab_size)), tp)
        if c.ffn_hidden_dim % tp:
            raise ConfigError(
                f"the SwiGLU hidden size {c.ffn_hidden_dim} (model.hidden_dim) is not divisible by "
                f"parallelism.tp={tp}"
            )
    checks.check_pipeline(parallelism, n_layers=c.n_layers, tied=c.enable_weight_tying)
    checks.check_attention_backend(c.attn_backend, parallelism)
