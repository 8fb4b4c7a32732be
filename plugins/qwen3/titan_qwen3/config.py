"""Qwen3 config schema, named flavors, parameter counts and validation.

Torch-free: the plugin module and Hydra's config store import this. The numbers
are TorchTitan v0.2.2's (``torchtitan/models/qwen3``: ``Qwen3ModelArgs`` and the
``qwen3_args`` flavors); Qwen3 gives ``head_dim`` explicitly (it is not dim / n_heads).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from titan_plugins.components import validation as checks
from titan_plugins.components.attention import AttentionBackend
from titan_plugins.components.attention_masks import AttentionMask
from titan_plugins.components.moe.config import MoEConfig, ScoreFunc
from titan_plugins.errors import ConfigError

__all__ = [
    "FLAVORS",
    "AttentionBackend",
    "AttentionMask",
    "Qwen3Config",
    "flops",
    "num_params",
    "validate",
]


@dataclass(kw_only=True)
class Qwen3Config:
    dim: int = 256
    n_layers: int = 8
    n_heads: int = 16
    n_kv_heads: int = 8
    head_dim: int = 128  # explicit in Qwen3: n_heads * head_dim may differ from dim
    vocab_size: int = 2048
    hidden_dim: int = 3072  # dense SwiGLU hidden size
    norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    qk_norm: bool = True  # per-head RMSNorm on q and k (over head_dim)
    max_seq_len: int = 4096  # length of the rotary cache
    depth_init: bool = True  # init std of block i scales with i (else with n_layers)
    enable_weight_tying: bool = False  # output.weight is tok_embeddings.weight

    attn_backend: AttentionBackend = AttentionBackend.auto
    attn_mask: AttentionMask = AttentionMask.causal
    eos_id: int = 151645  # block_causal separator; at launch the tokenizer's EOS id unless set

    # MoE: with moe_enabled, layer i is an MoE block unless it is in mlp_only_layers or
    # (i + 1) % decoder_sparse_step != 0 (Hugging Face Qwen3-MoE's schedule, same names);
    # those layers are dense SwiGLU blocks of hidden_dim. The released models and the
    # flavors use step 1 and no dense layers: every block is MoE.
    moe_enabled: bool = False
    moe_inter_dim: int = 768  # per-expert hidden size
    moe: MoEConfig = field(default_factory=MoEConfig)
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)

    @property
    def kv_group(self) -> int:
        return self.n_heads // self.n_kv_heads

    def is_moe_layer(self, layer_id: int) -> bool:
        return (self.moe_enabled and layer_id not in self.mlp_only_layers
                and (layer_id + 1) % self.decoder_sparse_step == 0)

    @property
    def n_moe_layers(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.n_layers))

    def check(self) -> None:
        """Model-only consistency; raises ConfigError naming the numbers."""
        for key in ("dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "vocab_size"):
            if getattr(self, key) < 1:
                raise ConfigError(f"model.{key}={getattr(self, key)} must be >= 1")
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(
                f"model.n_heads={self.n_heads} is not divisible by model.n_kv_heads={self.n_kv_heads}"
            )
        if self.head_dim % 2:
            raise ConfigError(f"model.head_dim={self.head_dim} must be even for RoPE")
        if self.decoder_sparse_step < 1:
            raise ConfigError(f"model.decoder_sparse_step={self.decoder_sparse_step} must be >= 1")
        # indices past n_layers name no layer, as in transformers (a partial load keeps the folder's list)
        bad = [i for i in self.mlp_only_layers if i < 0]
        if bad:
            raise ConfigError(f"model.mlp_only_layers holds layer {bad[0]}; layer indices are >= 0")
        if self.moe_enabled:
            self.moe.validate(key="model.moe")


def _moe(num_experts: int) -> MoEConfig:
    # Qwen3-MoE: no shared expert, softmax top-8 renormalised, scores applied to the
    # expert outputs; TorchTitan's default aux-loss-free balancing (coeff 1e-3).
    return MoEConfig(
        num_experts=num_experts,
        num_shared_experts=0,
        score_func=ScoreFunc.softmax,
        route_norm=True,
        route_scale=1.0,
        score_before_experts=False,
        top_k=8,
        load_balance_coeff=1e-3,
    )


def _dense(dim: int, n_layers: int, n_heads: int, hidden_dim: int, tied: bool) -> Qwen3Config:
    return Qwen3Config(
        dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=8, head_dim=128,
        vocab_size=151936, hidden_dim=hidden_dim, enable_weight_tying=tied,
    )


_DEBUG = Qwen3Config(
    dim=256, n_layers=8, n_heads=16, n_kv_heads=8, head_dim=128, vocab_size=2048,
    hidden_dim=3072, rope_theta=1_000_000.0, enable_weight_tying=True,
)

FLAVORS: dict[str, Qwen3Config] = {
    "debugmodel": _DEBUG,
    # TorchTitan's debugmodel_moe is untied (its flavor does not set weight tying).
    "debugmodel_moe": replace(
        _DEBUG, enable_weight_tying=False, moe_enabled=True, moe_inter_dim=768, moe=_moe(64)
    ),
    "0.6B": _dense(1024, 28, 16, 3072, tied=True),
    "1.7B": _dense(2048, 28, 16, 6144, tied=True),
    "4B": _dense(2560, 36, 32, 9728, tied=True),
    "8B": _dense(4096, 36, 32, 12288, tied=False),
    "14B": _dense(5120, 40, 40, 17408, tied=False),
    "32B": _dense(5120, 64, 64, 25600, tied=False),
    "30B-A3B": Qwen3Config(
        dim=2048, n_layers=48, n_heads=32, n_kv_heads=4, head_dim=128, vocab_size=151936,
        hidden_dim=6144, max_seq_len=262144, moe_enabled=True, moe_inter_dim=768, moe=_moe(128),
    ),
    "235B-A22B": Qwen3Config(
        dim=4096, n_layers=94, n_heads=64, n_kv_heads=4, head_dim=128, vocab_size=151936,
        hidden_dim=12288, rope_theta=5_000_000.0, moe_enabled=True, moe_inter_dim=1536,
        moe=_moe(128),
    ),
}


# ------------------------------------------------------------------- counting
def num_params(config: Qwen3Config) -> tuple[int, int]:
    """``(total, active)`` unique parameter counts, embeddings included (a tied
    output weight counted once). Active counts the router and ``top_k`` of the
    routed experts (TorchTitan's ``get_moe_model_nparams_and_flops``). ``build``
    on meta gives the same total (a test checks it)."""
    c = config
    d, hd = c.dim, c.head_dim
    attn = 2 * d * c.n_heads * hd + 2 * d * c.n_kv_heads * hd + (2 * hd if c.qk_norm else 0)
    per_layer = attn + 2 * d  # + attention_norm, ffn_norm
    n_moe = c.n_moe_layers
    dense = (c.n_layers - n_moe) * (per_layer + 3 * d * c.hidden_dim)
    moe_total = moe_active = 0
    if n_moe:
        e, k, s = c.moe.num_experts, c.moe.top_k, c.moe.num_shared_experts
        router, shared, routed = d * e, 3 * d * c.moe_inter_dim * s, 3 * d * c.moe_inter_dim * e
        moe_total = n_moe * (per_layer + router + shared + routed)
        moe_active = n_moe * (per_layer + router + shared + routed * k // e)
    embeddings = c.vocab_size * d * (1 if c.enable_weight_tying else 2)
    base = embeddings + d  # + final norm
    return base + dense + moe_total, base + dense + moe_active


def flops(config: Qwen3Config, seq_len: int) -> tuple[int, int]:
    """``(num_params, flops_per_token)``: 6 x active non-embedding parameters plus
    attention (TorchTitan's formula, with q/k + v head dims = 2 * head_dim)."""
    total, active = num_params(config)
    c = config
    non_embedding = active - c.vocab_size * c.dim
    attention = 6 * c.n_layers * c.n_heads * (2 * c.head_dim) * seq_len
    return total, 6 * non_embedding + attention


# ------------------------------------------------------------------ validation
def validate(config: Qwen3Config, parallelism: Any) -> None:
    """Degrees against the model, before any worker starts; one line naming both
    numbers. ``parallelism`` is a ``ParallelismConfig``, a DictConfig or ParallelDims."""
    c = config
    c.check()
    tp, ep, etp = (int(checks.degree(parallelism, k)) for k in ("tp", "ep", "etp"))
    n_moe = c.n_moe_layers
    if tp > 1:
        checks.check_divisible(((key, getattr(c, key)) for key in ("n_heads", "n_kv_heads", "vocab_size")), tp)
        if n_moe < c.n_layers:  # dense blocks shard hidden_dim
            checks.check_divisible((("hidden_dim", c.hidden_dim),), tp)
    expert_tp = (etp if ep > 1 else tp) if n_moe else 1
    if expert_tp > 1 and c.moe_inter_dim % expert_tp:
        key = "etp" if ep > 1 else "tp"
        raise ConfigError(
            f"model.moe_inter_dim={c.moe_inter_dim} is not divisible by parallelism.{key}={expert_tp}"
        )
    if ep > 1:
        if not c.moe_enabled:
            raise ConfigError(f"parallelism.ep={ep} needs an MoE flavor, but model.moe_enabled=false")
        if not n_moe:
            raise ConfigError(f"parallelism.ep={ep} needs MoE layers, but model.mlp_only_layers / "
                              f"model.decoder_sparse_step={c.decoder_sparse_step} leave none")
        if c.moe.num_experts % ep:
            raise ConfigError(
                f"model.moe.num_experts={c.moe.num_experts} is not divisible by parallelism.ep={ep}"
            )
    checks.check_pipeline(parallelism, n_layers=c.n_layers, tied=c.enable_weight_tying)
    checks.check_attention_backend(c.attn_backend, parallelism)
