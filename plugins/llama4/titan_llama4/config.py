"""Llama 4 config schema, named flavors, derived sizes and parameter counts.

Torch-free: the plugin module and Hydra's config store import this. The numbers
follow TorchTitan v0.2.2's ``torchtitan/models/llama4`` (``args.py`` and the
flavors in ``__init__.py``); every derived size is computed here, once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from titan_plugins.components import validation as checks
from titan_plugins.components.attention import AttentionBackend
from titan_plugins.components.attention_masks import AttentionMask
from titan_plugins.components.moe.config import MoEConfig, ScoreFunc
from titan_plugins.components.rope_config import RoPEScaling as Llama31Scaling
from titan_plugins.errors import ConfigError

__all__ = [
    "FLAVORS",
    "AttentionBackend",
    "AttentionMask",
    "Llama4Config",
    "RoPEScaling",
    "flops",
    "num_params",
    "validate",
]


@dataclass
class RoPEScaling(Llama31Scaling):
    """Llama 3.1-style frequency scaling with TorchTitan's Llama 4 defaults (factor 16,
    an empty interpolation band); ``enabled=False`` stands for TorchTitan's
    ``rope_scaling_args=None``."""

    scaling_factor: float = 16.0
    high_freq_factor: float = 1.0


@dataclass(kw_only=True)
class Llama4Config:
    dim: int = 256
    n_layers: int = 6
    n_heads: int = 16
    n_kv_heads: int | None = None  # None: multi-head attention (= n_heads)
    vocab_size: int = 2048
    multiple_of: int = 256  # SwiGLU hidden sizes round up to a multiple of this
    ffn_dim_multiplier: float | None = None
    # Explicit SwiGLU hidden sizes (a Hugging Face config.json states them: intermediate_size_mlp
    # and intermediate_size); None: TorchTitan's rule from dim, ffn_dim_multiplier, multiple_of.
    hidden_dim: int | None = None  # dense layers
    moe_inter_dim: int | None = None  # each routed expert (and the shared expert)
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    rope_scaling: RoPEScaling = field(default_factory=lambda: RoPEScaling(enabled=False))
    # Length of the rotary cache (TorchTitan sets it to the training seq_len).
    max_seq_len: int = 2048
    depth_init: bool = True  # init std of block i scales with i (else with n_layers)

    # iRoPE: every n-th layer (0, n, 2n, ...) has no rotary embedding and full causal
    # attention; the others attend causally within chunks of fixed_attn_block_size.
    every_n_layers_nope: int | None = None
    # Hugging Face's placement (its no_rope_layers; its default is every (i + 1) % 4 == 0):
    # the layer indices without RoPE. Set (even empty), it replaces every_n_layers_nope.
    nope_layers: list[int] | None = None
    fixed_attn_block_size: int | None = 8192  # None: RoPE layers attend fully (HF attention_chunk_size=null)
    # Llama 4 Scout's extras, off in TorchTitan: L2-normalised q and k (no weights, eps
    # norm_eps) after RoPE on RoPE layers; query temperature on NoPE layers, scaled by
    # 1 + attn_scale * log1p(floor((position + 1) / floor_scale)).
    qk_norm: bool = False
    attn_temperature_tuning: bool = False
    floor_scale: int = 8192
    attn_scale: float = 0.1
    # Kernel of the chunked-local (iRoPE) and document-masked layers; plain causal layers use SDPA.
    attn_backend: AttentionBackend = AttentionBackend.auto
    # block_causal (TorchTitan's irope flavors): no attention across documents, each
    # ending at eos_id. 2047 is the shipped tokenizer's <|eos|> (the debug flavors'
    # vocabulary); at launch the tokenizer's EOS id replaces it unless set.
    attn_mask: AttentionMask = AttentionMask.causal
    eos_id: int = 2047

    # MoE: layer i is an MoE block when (i + 1) % interleave_moe_layer_step == 0,
    # or, where moe_layers is set (Hugging Face's list), when i is in moe_layers.
    moe: MoEConfig = field(default_factory=MoEConfig)
    interleave_moe_layer_step: int = 2
    moe_layers: list[int] | None = None
    # Divide the experts' hidden size by top_k + num_shared_experts (TorchTitan's default).
    auto_scale_hidden_dim: bool = True

    # ------------------------------------------------------------ derived sizes
    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def kv_heads(self) -> int:
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    def _swiglu_base(self) -> int:
        hidden = int(2 * (4 * self.dim) / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return hidden

    @property
    def ffn_hidden_dim(self) -> int:
        """Dense SwiGLU hidden size: 2/3 of 4*dim, times the multiplier, rounded up."""
        if self.hidden_dim is not None:
            return self.hidden_dim
        m = self.multiple_of
        return m * ((self._swiglu_base() + m - 1) // m)

    @property
    def moe_hidden_dim(self) -> int:
        """Per-expert hidden size (the shared expert has num_shared_experts times this)."""
        if self.moe_inter_dim is not None:
            return self.moe_inter_dim
        hidden = self._swiglu_base()
        if self.auto_scale_hidden_dim:
            hidden = int(hidden / (self.moe.top_k + self.moe.num_shared_experts))
        return hidden + (-hidden % self.multiple_of)

    def is_moe_layer(self, layer_id: int) -> bool:
        if self.moe_layers is not None:
            return layer_id in self.moe_layers
        return (layer_id + 1) % self.interleave_moe_layer_step == 0

    @property
    def irope(self) -> bool:
        """Some layers may go without RoPE, the others attend within chunks."""
        return self.nope_layers is not None or self.every_n_layers_nope is not None

    def uses_rope(self, layer_id: int) -> bool:
        if self.nope_layers is not None:
            return layer_id not in self.nope_layers
        n = self.every_n_layers_nope
        return n is None or layer_id % n != 0

    def attn_chunk_size(self, layer_id: int) -> int | None:
        """Chunk of the local attention of layer ``layer_id``; None for full causal."""
        if not self.irope or not self.uses_rope(layer_id):
            return None
        return self.fixed_attn_block_size

    def check(self) -> None:
        """Model-only consistency; raises ConfigError naming the numbers."""
        if self.dim % self.n_heads:
            raise ConfigError(
                f"model.dim={self.dim} is not divisible by model.n_heads={self.n_heads}"
            )
        if self.head_dim % 2:
            raise ConfigError(f"model head_dim={self.head_dim} (dim/n_heads) must be even for RoPE")
        if self.n_heads % self.kv_heads:
            raise ConfigError(
                f"model.n_heads={self.n_heads} is not divisible by model.n_kv_heads={self.kv_heads}"
            )
        if self.every_n_layers_nope is not None and self.every_n_layers_nope <= 1:
            raise ConfigError(f"model.every_n_layers_nope={self.every_n_layers_nope} must be > 1")
        for key in ("nope_layers", "moe_layers"):
            bad = [i for i in getattr(self, key) or () if not 0 <= i < self.n_layers]
            if bad:
                raise ConfigError(f"model.{key} holds layer {bad[0]}, outside [0, model.n_layers={self.n_layers})")
        for key in ("fixed_attn_block_size", "floor_scale", "hidden_dim", "moe_inter_dim"):
            value = getattr(self, key)
            if value is not None and value < 1:
                raise ConfigError(f"model.{key}={value} must be >= 1")
        if self.interleave_moe_layer_step < 1:
            raise ConfigError(
                f"model.interleave_moe_layer_step={self.interleave_moe_layer_step} must be >= 1"
            )
        if self.attn_mask is AttentionMask.block_causal and not 0 <= self.eos_id < self.vocab_size:
            raise ConfigError(
                f"model.eos_id={self.eos_id} is outside the vocabulary [0, model.vocab_size={self.vocab_size})"
            )
        self.moe.validate(key="model.moe")


def _moe(num_experts: int) -> MoEConfig:
    # TorchTitan's MoEArgs defaults: 1 shared expert, sigmoid scores applied to the
    # expert inputs, top-1, aux-loss-free balancing with coeff 1e-3.
    return MoEConfig(
        num_experts=num_experts, num_shared_experts=1, top_k=1, load_balance_coeff=1e-3,
        score_func=ScoreFunc.sigmoid, route_norm=False, route_scale=1.0, score_before_experts=True,
    )


def _debugmodel(**kw: Any) -> Llama4Config:
    return Llama4Config(
        dim=256,
        n_layers=6,
        n_heads=16,
        vocab_size=2048,
        rope_theta=500000.0,
        rope_scaling=RoPEScaling(),
        moe=_moe(8),
        interleave_moe_layer_step=2,
        **kw,
    )


def _published(num_experts: int, interleave: int, scaling: bool, **kw: Any) -> Llama4Config:
    # Scout (17Bx16E) and Maverick (17Bx128E). TorchTitan's vocab default 202048.
    return Llama4Config(
        dim=5120,
        n_layers=48,
        n_heads=40,
        n_kv_heads=8,
        vocab_size=202048,
        ffn_dim_multiplier=1.2,
        multiple_of=2048,
        rope_theta=500000.0,
        rope_scaling=RoPEScaling(enabled=scaling),
        max_seq_len=8192,
        moe=_moe(num_experts),
        interleave_moe_layer_step=interleave,
        eos_id=200001,  # Llama 4's <|end_of_text|>
        **kw,
    )


FLAVORS: dict[str, Llama4Config] = {
    "debugmodel": _debugmodel(),
    "debugmodel_irope": _debugmodel(
        every_n_layers_nope=4, fixed_attn_block_size=256, attn_mask=AttentionMask.block_causal
    ),
    "17bx16e": _published(16, interleave=1, scaling=True),
    "17bx128e": _published(128, interleave=2, scaling=False),
    "17bx16e_irope": _published(
        16, interleave=1, scaling=True, every_n_layers_nope=4, attn_mask=AttentionMask.block_causal
    ),
    "17bx128e_irope": _published(
        128, interleave=2, scaling=False, every_n_layers_nope=4, attn_mask=AttentionMask.block_causal
    ),
}


# ------------------------------------------------------------------- counting
def num_params(config: Llama4Config) -> tuple[int, int]:
    """``(total, active)`` parameter counts, embeddings included.

    Active counts the router, the shared experts and ``top_k`` of the routed experts
    (TorchTitan's ``get_moe_model_nparams_and_flops``). ``build`` on meta gives the
    same total (a test checks it).
    """
    c = config
    d, hd = c.dim, c.head_dim
    attn = d * c.n_heads * hd * 2 + d * c.kv_heads * hd * 2
    norms = 2 * d
    dense_ffn = 3 * d * c.ffn_hidden_dim
    h = c.moe_hidden_dim
    e, k, s = c.moe.num_experts, c.moe.top_k, c.moe.num_shared_experts
    router, shared, routed = d * e, 3 * d * h * s, 3 * d * h * e
    n_moe = sum(c.is_moe_layer(i) for i in range(c.n_layers))
    n_dense = c.n_layers - n_moe
    base = c.n_layers * (attn + norms) + n_dense * dense_ffn + 2 * c.vocab_size * d + d
    total = base + n_moe * (router + shared + routed)
    active = base + n_moe * (router + shared + routed * k // e)
    return total, active


def flops(config: Llama4Config, seq_len: int) -> tuple[int, int]:
    """``(num_params, flops_per_token)``: 6 x active non-embedding parameters plus
    attention (TorchTitan's formula, with head dims q/k + v = 2 * head_dim)."""
    total, active = num_params(config)
    embedding = config.vocab_size * config.dim
    per_token = (
        6 * (active - embedding)
        + 6 * config.n_layers * config.n_heads * (2 * config.head_dim) * seq_len
    )
    return total, per_token


# ------------------------------------------------------------------ validation
def validate(config: Llama4Config, parallelism: Any) -> None:
    """Degrees against the model, before any worker starts; one line naming both
    numbers. ``parallelism`` is a ``ParallelismConfig``, a DictConfig or a ParallelDims."""
    config.check()
    tp, ep, etp = (int(checks.degree(parallelism, k)) for k in ("tp", "ep", "etp"))
    c = config
    n_moe = sum(c.is_moe_layer(i) for i in range(c.n_layers))
    if tp > 1:
        checks.check_divisible((("n_heads", c.n_heads), ("n_kv_heads", c.kv_heads), ("vocab_size", c.vocab_size)), tp)
        if n_moe < c.n_layers and c.ffn_hidden_dim % tp:
            raise ConfigError(
                f"model dense FFN hidden size {c.ffn_hidden_dim} is not divisible by parallelism.tp={tp}"
            )
        expert_tp = etp if ep > 1 else tp
        if n_moe and expert_tp > 1 and c.moe_hidden_dim % expert_tp:
            raise ConfigError(
                f"model expert hidden size {c.moe_hidden_dim} is not divisible by "
                f"parallelism.{'etp' if ep > 1 else 'tp'}={expert_tp}"
            )
    if ep > 1:
        if not n_moe:
            raise ConfigError(
                f"parallelism.ep={ep} but model has no MoE layer "
                f"(n_layers={c.n_layers}, interleave_moe_layer_step={c.interleave_moe_layer_step})"
            )
        if c.moe.num_experts % ep:
            raise ConfigError(
                f"model.moe.num_experts={c.moe.num_experts} is not divisible by parallelism.ep={ep}"
            )
    checks.check_pipeline(parallelism, n_layers=c.n_layers)
