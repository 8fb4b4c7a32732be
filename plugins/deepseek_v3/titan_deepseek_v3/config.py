"""DeepSeek-V3 configuration: a hierarchical schema and the named flavors.

The schema mirrors TorchTitan 0.2.2's ``DeepSeekV3ModelArgs`` grouped by where each
setting acts (model -> layer -> attention / rope / norm / ffn / moe), the parameter
and FLOP counts, and the checks against the parallel degrees;
``from_torchtitan`` and ``to_torchtitan`` map one onto the other field by field.
Derived dimensions (``qk_head_dim``, YaRN on/off, the softmax scale) are computed
here and nowhere else. This module must not import torch (``titan-plugins list``).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from titan_plugins.components.moe.config import MoEConfig, ScoreFunc
from titan_plugins.errors import ConfigError

__all__ = [
    "AttentionConfig",
    "DeepSeekV3Config",
    "FFNConfig",
    "FLAVORS",
    "LayerConfig",
    "MoELayerConfig",
    "NormConfig",
    "RopeConfig",
    "ParamCounts",
    "RopeScaling",
    "flops",
    "from_torchtitan",
    "make_config",
    "param_counts",
    "to_torchtitan",
    "validate",
]


@dataclass(kw_only=True)
class AttentionConfig:
    """Multi-head Latent Attention (TorchTitan: ``n_heads``, ``*_lora_rank``, ``*_head_dim``)."""

    n_heads: int = 16
    q_lora_rank: int = 0  # 0: one full-rank wq; > 0: wq_a -> q_norm -> wq_b
    kv_lora_rank: int = 512  # the compressed kv (normed by kv_norm)
    qk_nope_head_dim: int = 128  # per-head q/k dims without rotary embedding
    qk_rope_head_dim: int = 64  # decoupled rotary dims (k_pe is shared by all heads)
    v_head_dim: int = 128

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


class RopeScaling(str, Enum):
    """When YaRN is applied."""

    auto = "auto"  # TorchTitan's rule: when max_seq_len > original_seq_len
    yarn = "yarn"  # always (Hugging Face rope_type "yarn")
    none = "none"  # never: plain RoPE (Hugging Face rope_type "default")


@dataclass(kw_only=True)
class RopeConfig:
    """Rotary embedding with YaRN (TorchTitan: ``rope_theta``, ``rope_factor``, ...).

    With ``scaling=auto`` YaRN, and the ``mscale`` it brings to the softmax scale, is
    active only when the model's ``max_seq_len`` exceeds ``original_seq_len``
    (TorchTitan's rule); a Hugging Face config.json says ``yarn`` or ``none``.
    """

    theta: float = 10000.0
    scaling: RopeScaling = RopeScaling.auto
    factor: float = 40.0
    beta_fast: int = 32
    beta_slow: int = 1
    original_seq_len: int = 4096
    mscale: float = 1.0  # softmax-scale mscale (Hugging Face: mscale_all_dim)
    # YaRN's magnitude on the rotary cos/sin (Hugging Face: attention_factor, derived
    # from mscale / mscale_all_dim); TorchTitan has none (1.0).
    attention_factor: float = 1.0


@dataclass(kw_only=True)
class NormConfig:
    eps: float = 1e-5  # RMSNorm eps of the block norms (Hugging Face: rms_norm_eps)
    # The q/kv latent norms: None = eps (TorchTitan); Hugging Face hard-codes 1e-6.
    latent_eps: float | None = None
    # The final norm: None = torch.finfo(dtype).eps (TorchTitan); Hugging Face: rms_norm_eps.
    final_eps: float | None = None

    @property
    def latent(self) -> float:
        return self.eps if self.latent_eps is None else self.latent_eps


@dataclass(kw_only=True)
class FFNConfig:
    hidden_dim: int = 10944  # dense SwiGLU (TorchTitan: inter_dim)


@dataclass(kw_only=True)
class MoELayerConfig(MoEConfig):
    """The shared MoE component's settings plus the routed experts' width."""

    hidden_dim: int = 1408  # per routed expert; shared experts get hidden_dim * num_shared_experts


@dataclass(kw_only=True)
class LayerConfig:
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    rope: RopeConfig = field(default_factory=RopeConfig)
    norm: NormConfig = field(default_factory=NormConfig)
    ffn: FFNConfig = field(default_factory=FFNConfig)
    moe: MoELayerConfig = field(default_factory=MoELayerConfig)


@dataclass(kw_only=True)
class DeepSeekV3Config:
    """The ``model`` node of a job (``model=deepseek_v3 model.flavor=16B model.n_layers=4``).

    ``max_seq_len`` is TorchTitan's: its trainer sets it to ``training.seq_len``, and it
    decides whether YaRN is active. The Hydra option ``model=deepseek_v3`` sets it to
    ``${training.seq_len}`` so a run matches TorchTitan's; override it to differ.
    """

    vocab_size: int = 102400
    dim: int = 2048
    n_layers: int = 27
    n_dense_layers: int = 1  # the first n_dense_layers blocks use the dense FFN, the rest MoE
    max_seq_len: int = 16384
    layer: LayerConfig = field(default_factory=LayerConfig)

    # ------------------------------------------------------------ derived
    @property
    def yarn_enabled(self) -> bool:
        rope = self.layer.rope
        scaling = RopeScaling(rope.scaling)
        if scaling is RopeScaling.auto:
            return self.max_seq_len > rope.original_seq_len
        return scaling is RopeScaling.yarn

    @property
    def softmax_scale(self) -> float:
        """``qk_head_dim ** -0.5``, times ``mscale**2`` with YaRN's
        ``mscale = 0.1 * rope.mscale * ln(rope.factor) + 1`` when YaRN is active."""
        scale = self.layer.attention.qk_head_dim**-0.5
        if self.yarn_enabled:
            rope = self.layer.rope
            mscale = 0.1 * rope.mscale * math.log(rope.factor) + 1.0
            scale = scale * mscale * mscale
        return scale

    def is_moe_layer(self, layer_id: int) -> bool:
        return layer_id >= self.n_dense_layers

    def validate(self) -> None:
        """Raise ConfigError naming the numbers that disagree."""
        for key in ("vocab_size", "dim", "n_layers", "max_seq_len"):
            if getattr(self, key) < 1:
                raise ConfigError(f"model.{key}={getattr(self, key)} must be >= 1")
        if not 0 <= self.n_dense_layers <= self.n_layers:
            raise ConfigError(
                f"model.n_dense_layers={self.n_dense_layers} must be in [0, model.n_layers={self.n_layers}]"
            )
        att = self.layer.attention
        for key in ("n_heads", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            if getattr(att, key) < 1:
                raise ConfigError(f"model.layer.attention.{key}={getattr(att, key)} must be >= 1")
        if att.q_lora_rank < 0:
            raise ConfigError(f"model.layer.attention.q_lora_rank={att.q_lora_rank} must be >= 0")
        if att.qk_rope_head_dim % 2:
            raise ConfigError(
                f"model.layer.attention.qk_rope_head_dim={att.qk_rope_head_dim} must be even"
            )
        norm, rope = self.layer.norm, self.layer.rope
        for key in ("eps", "latent_eps", "final_eps"):
            value = getattr(norm, key)
            if value is not None and not value > 0:
                raise ConfigError(f"model.layer.norm.{key}={value} must be > 0")
        if not rope.attention_factor > 0:
            raise ConfigError(f"model.layer.rope.attention_factor={rope.attention_factor} must be > 0")
        if self.n_dense_layers < self.n_layers:
            self.layer.moe.validate(key="model.layer.moe")


def _flavor(
    vocab_size: int, dim: int, n_layers: int, n_dense_layers: int, *, attention: AttentionConfig,
    mscale: float, ffn_hidden_dim: int, moe: MoELayerConfig,
) -> DeepSeekV3Config:
    return DeepSeekV3Config(
        vocab_size=vocab_size, dim=dim, n_layers=n_layers, n_dense_layers=n_dense_layers,
        layer=LayerConfig(attention=attention, rope=RopeConfig(mscale=mscale),
                          ffn=FFNConfig(hidden_dim=ffn_hidden_dim), moe=moe),
    )


def _softmax_moe(hidden_dim: int, num_experts: int, top_k: int) -> MoELayerConfig:
    # TorchTitan's debugmodel and 16B: two shared experts, softmax scores, no renormalising.
    return MoELayerConfig(
        hidden_dim=hidden_dim, num_experts=num_experts, num_shared_experts=2, top_k=top_k,
        score_func=ScoreFunc.softmax, route_norm=False, score_before_experts=False,
    )


def _debugmodel() -> DeepSeekV3Config:
    # TorchTitan v0.2.2's "debugmodel".
    attention = AttentionConfig(n_heads=16, q_lora_rank=0, kv_lora_rank=512,
                                qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
    return _flavor(2048, 256, 6, 1, attention=attention, mscale=0.70, ffn_hidden_dim=1024,
                   moe=_softmax_moe(256, 8, top_k=3))


def _16b() -> DeepSeekV3Config:
    # DeepSeek-V2-Lite shapes (TorchTitan's "16B").
    return _flavor(102400, 2048, 27, 1, attention=AttentionConfig(n_heads=16, q_lora_rank=0, kv_lora_rank=512),
                   mscale=0.70, ffn_hidden_dim=10944, moe=_softmax_moe(1408, 64, top_k=6))


def _671b() -> DeepSeekV3Config:
    # The published DeepSeek-V3 shapes (TorchTitan's "671B").
    moe = MoELayerConfig(
        hidden_dim=2048, num_experts=256, num_shared_experts=1, top_k=8, num_expert_groups=8,
        num_limited_groups=4, score_func=ScoreFunc.sigmoid, route_norm=True, route_scale=2.5,
        score_before_experts=False,
    )
    return _flavor(129280, 7168, 61, 3, attention=AttentionConfig(n_heads=128, q_lora_rank=1536, kv_lora_rank=512),
                   mscale=1.0, ffn_hidden_dim=18432, moe=moe)


FLAVORS: dict[str, DeepSeekV3Config] = {
    "debugmodel": _debugmodel(),
    "16B": _16b(),
    "671B": _671b(),
}


# ------------------------------------------------------------------ make_config
def _leaf_paths(cls: type, prefix: tuple[str, ...] = ()) -> dict[str, list[tuple[str, ...]]]:
    """``leaf name -> [paths]`` over the schema (for ``make_config`` shortcuts)."""
    out: dict[str, list[tuple[str, ...]]] = {}
    for f in dataclasses.fields(cls):
        path = (*prefix, f.name)
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else None
        if dataclasses.is_dataclass(default):
            for name, paths in _leaf_paths(type(default), path).items():
                out.setdefault(name, []).extend(paths)
        else:
            out.setdefault(f.name, []).append(path)
    return out


def make_config(flavor: str = "debugmodel", **overrides: Any) -> DeepSeekV3Config:
    """A flavor with overrides, type-checked like a Hydra override.

    A key is a top-level field (``n_layers=2``), a section given as a dict
    (``layer={"moe": {"top_k": 2}}``), a ``__``-separated path
    (``layer__attention__n_heads=4``) or a leaf name that occurs once in the schema
    (``n_heads=4``, ``num_experts=4``, ``kv_lora_rank=64``). ``hidden_dim`` is
    ambiguous: say ``ffn__hidden_dim`` or ``moe__hidden_dim`` (the ``layer__`` prefix
    may be left out).

        make_config(n_layers=2, n_heads=4, max_seq_len=64)
    """
    from omegaconf import OmegaConf

    if flavor not in FLAVORS:
        raise ValueError(f"unknown flavor {flavor!r} (choose from: {', '.join(FLAVORS)})")
    top = {f.name for f in dataclasses.fields(DeepSeekV3Config)}
    sections = {f.name for f in dataclasses.fields(LayerConfig)}
    leaves = _leaf_paths(DeepSeekV3Config)
    nested: dict[str, Any] = {}
    for key, value in overrides.items():
        if "__" in key:
            path = tuple(key.split("__"))
            if path[0] in sections:
                path = ("layer", *path)
        elif key in top:
            path = (key,)
        elif key in sections:
            path = ("layer", key)
        elif key in leaves and len(leaves[key]) == 1:
            path = leaves[key][0]
        elif key in leaves:
            options = ", ".join("__".join(p[1:] if p[0] == "layer" else p) for p in leaves[key])
            raise TypeError(f"make_config: {key!r} is ambiguous, use one of: {options}")
        else:
            raise TypeError(f"make_config: unknown key {key!r}")
        node = nested
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = value
    try:
        merged = OmegaConf.merge(OmegaConf.structured(FLAVORS[flavor]), nested)
        config = OmegaConf.to_object(merged)
    except Exception as exc:
        key = getattr(exc, "full_key", None)
        where = f"{key}: " if key else ""
        raise TypeError(f"make_config: {where}{str(exc).splitlines()[0]}") from exc
    config.validate()
    return config


# ------------------------------------------------------ TorchTitan <-> this schema
_TT_ATTENTION = ("n_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
_TT_ROPE = {  # TorchTitan field -> RopeConfig field
    "rope_theta": "theta", "rope_factor": "factor", "beta_fast": "beta_fast",
    "beta_slow": "beta_slow", "original_seq_len": "original_seq_len", "mscale": "mscale",
}
_TT_MOE = (
    "num_experts", "num_shared_experts", "score_func", "route_norm", "route_scale",
    "score_before_experts", "num_expert_groups", "num_limited_groups", "use_grouped_mm",
    "top_k", "load_balance_coeff",
)


def from_torchtitan(args: Any) -> DeepSeekV3Config:
    """This schema from a TorchTitan ``DeepSeekV3ModelArgs`` (duck-typed: any object
    with its attributes). Only SDPA with a causal mask is implemented here."""
    moe = args.moe_args
    return DeepSeekV3Config(
        vocab_size=args.vocab_size,
        dim=args.dim,
        n_layers=args.n_layers,
        n_dense_layers=args.n_dense_layers,
        max_seq_len=args.max_seq_len,
        layer=LayerConfig(
            attention=AttentionConfig(**{k: getattr(args, k) for k in _TT_ATTENTION}),
            rope=RopeConfig(**{ours: getattr(args, tt) for tt, ours in _TT_ROPE.items()}),
            norm=NormConfig(eps=args.norm_eps),
            ffn=FFNConfig(hidden_dim=args.inter_dim),
            moe=MoELayerConfig(
                hidden_dim=args.moe_inter_dim,
                **{k: (ScoreFunc(getattr(moe, k)) if k == "score_func" else getattr(moe, k)) for k in _TT_MOE},
            ),
        ),
    )


def to_torchtitan(config: DeepSeekV3Config) -> dict[str, Any]:
    """Keyword arguments for TorchTitan's ``DeepSeekV3ModelArgs`` (``moe_args`` as a dict
    of ``MoEArgs`` keywords). Settings TorchTitan has no argument for must be at
    TorchTitan's value (ConfigError naming the field otherwise)."""
    layer = config.layer
    fixed = {"layer.rope.scaling": (RopeScaling(layer.rope.scaling).value, "auto"),
             "layer.rope.attention_factor": (layer.rope.attention_factor, 1.0),
             "layer.norm.latent_eps": (layer.norm.latent_eps, None),
             "layer.norm.final_eps": (layer.norm.final_eps, None)}
    for key, (value, torchtitan) in fixed.items():
        if value != torchtitan:
            raise ConfigError(f"model.{key}={value!r} has no TorchTitan equivalent (it has {torchtitan!r} only)")
    moe = {k: getattr(layer.moe, k) for k in _TT_MOE}
    moe["score_func"] = ScoreFunc(moe["score_func"]).value
    return {
        "vocab_size": config.vocab_size,
        "dim": config.dim,
        "n_layers": config.n_layers,
        "n_dense_layers": config.n_dense_layers,
        "max_seq_len": config.max_seq_len,
        "norm_eps": layer.norm.eps,
        "inter_dim": layer.ffn.hidden_dim,
        "moe_inter_dim": layer.moe.hidden_dim,
        "moe_args": moe,
        **{k: getattr(layer.attention, k) for k in _TT_ATTENTION},
        **{tt: getattr(layer.rope, ours) for tt, ours in _TT_ROPE.items()},
    }


# ------------------------------------------------------------------- counting
# Exact, from the config alone: the counts match a built model's named_parameters()
# (a test checks it on meta); ``active`` counts routed experts by top_k / num_experts.
@dataclass(frozen=True)
class ParamCounts:
    total: int
    active: int  # per token: dense + router + shared experts + top_k routed experts
    embedding: int
    routed_experts: int


def param_counts(config: DeepSeekV3Config) -> ParamCounts:
    dim, layer = config.dim, config.layer
    att, moe = layer.attention, layer.moe
    q = dim * att.n_heads * att.qk_head_dim if att.q_lora_rank == 0 else (
        dim * att.q_lora_rank + att.q_lora_rank + att.q_lora_rank * att.n_heads * att.qk_head_dim
    )
    attention = (
        q
        + dim * (att.kv_lora_rank + att.qk_rope_head_dim)  # wkv_a
        + att.kv_lora_rank  # kv_norm
        + att.kv_lora_rank * att.n_heads * (att.qk_nope_head_dim + att.v_head_dim)  # wkv_b
        + att.n_heads * att.v_head_dim * dim  # wo
    )
    norms = 2 * dim
    dense_ffn = 3 * dim * layer.ffn.hidden_dim
    routed = 3 * moe.num_experts * dim * moe.hidden_dim
    router = dim * moe.num_experts
    shared = 3 * dim * moe.hidden_dim * moe.num_shared_experts
    n_moe = config.n_layers - config.n_dense_layers
    embedding = config.vocab_size * dim
    dense = (
        embedding + dim + dim * config.vocab_size  # tok_embeddings, final norm, lm_head
        + config.n_layers * (attention + norms) + config.n_dense_layers * dense_ffn
    )
    total = dense + n_moe * (router + shared + routed)
    active = dense + n_moe * (router + shared + routed * moe.top_k // moe.num_experts)
    return ParamCounts(total=total, active=active, embedding=embedding, routed_experts=n_moe * routed)


def flops(config: DeepSeekV3Config, seq_len: int) -> tuple[int, int]:
    """``(num_params, flops_per_token)`` as TorchTitan counts them: 6 x active
    non-embedding parameters + 6 x layers x heads x (qk + v head dims) x seq_len."""
    counts = param_counts(config)
    att = config.layer.attention
    head_dims = att.qk_nope_head_dim + att.qk_rope_head_dim + att.v_head_dim
    per_token = 6 * (counts.active - counts.embedding) + 6 * config.n_layers * att.n_heads * head_dims * seq_len
    return counts.total, per_token


# ------------------------------------------------------------------ validation
def _divides(value: int, value_key: str, degree: int, degree_key: str) -> None:
    if degree > 1 and value % degree:
        raise ConfigError(f"{value_key}={value} is not divisible by {degree_key}={degree}")


def validate(config: DeepSeekV3Config, parallelism: Any) -> None:
    """Degrees against the model, before any worker starts: ``ConfigError`` with one line
    naming the two numbers that disagree. ``parallelism`` is the job's ``parallelism``
    node or a ``ParallelDims`` (anything with ``tp``, ``ep``, ``etp``, ``pp`` attributes)."""
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
