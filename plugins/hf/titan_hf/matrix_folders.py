"""A tiny random transformers folder for any ``model_type`` (the matrix's inputs).

    folder = tiny_folder("qwen2_moe", tmp_path / "qwen2_moe")   # config.json + model.safetensors

The config starts from ``AutoConfig.for_model(model_type)`` (the architecture's own
defaults) and is shrunk generically: only attributes the config has are set (hidden
64, 2 layers, 4 heads / 2 key-value heads, head_dim 16, vocabulary 256, 128 positions;
MoE: 4 experts, top 2, small expert sizes), per-layer lists are cut to the layers kept
(one of each kind first, so a sliding + full model keeps both), token ids fit the
vocabulary and dropout is off (both sides train, fp32), and so is the training-time
noise of a ``*jitter*`` field (:func:`zeroed_noise`: PhiMoE's ``router_jitter_noise``).
Every float multiplier, scale, scaling or soft-cap field left at ``1.0`` or ``None``
gets a value that changes the loss, so a skipped scale shows up. Weights are random
with std 0.2 (matrices) or 0.2 around their initial value (norm weights near 1, or
near 0 for ``1 + w`` norms); embeddings' padding rows stay zero.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch

__all__ = ["SIZES", "tiny_config", "tiny_folder", "zeroed_noise"]

#: shape fields set wherever the config has them
SIZES: dict[str, Any] = dict(
    hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, vocab_size=256, max_position_embeddings=128, sliding_window=8, rotary_dim=8, kv_channels=16,
    ffn_hidden_size=96, attention_head_dim=16, global_head_dim=16,
    # mixture of experts
    moe_intermediate_size=32, expert_intermediate_size=32, moe_ffn_hidden_size=32, num_experts=4,
    num_local_experts=4, n_routed_experts=4, moe_num_experts=4, num_experts_per_tok=2, moe_topk=2,
    num_experts_per_token=2, moe_k=2, top_k=2, first_k_dense_replace=1, n_group=1, topk_group=1,
    decoder_sparse_step=1, shared_expert_intermediate_size=32, n_shared_experts=1, num_shared_experts=1,
    # multi-head latent attention
    q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
)
_TOKENS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
_CORE = ("hidden_size", "num_hidden_layers", "vocab_size", "num_attention_heads")  # never given up
_DROPOUT = re.compile(r"dropout|pdrop|drop_prob|layerdrop")
# Training-time random noise, set to 0 like dropout. PhiMoE's router samples its experts
# in training (sparsemixer: Gumbel draws among the experts within 2 * router_jitter_noise,
# relative, of the best one), so a run equals another only where both draw the same
# numbers for the same tokens; a layout's ranks hold other rows (fsdp2, ep2), positions
# (cp2) or layers (pp2) and draw other numbers than one rank does: the layout columns
# would measure the noise (2.5e-02 on fsdp2), not the layout. At 0 the best expert is
# the only candidate, so the draws change nothing (routing is plain top-k). The row says
# so (zeroed_noise, titan_hf.matrix).
_NOISE = re.compile(r"jitter")
_SCALE = re.compile(r"(multiplier|scale|scaling|softcap|softcapping)$")
_NOT_SCALES = {"rope_scaling"}  # dicts / switches, not numbers


def _nontrivial(key: str, value: Any) -> Any:
    """A value for scale field ``key`` (default ``value``) that changes the loss, or ``None``."""
    if key in _NOT_SCALES or isinstance(value, bool):
        return None
    soft = "softcap" in key
    if soft and (value is None or isinstance(value, float)):
        return 5.0  # below the logits' range: a cap skipped shows up
    if value is None and (key.endswith("_scale") or key.endswith("_multiplier")):
        return 0.5
    if isinstance(value, float) and value == 1.0:
        return 0.75
    if isinstance(value, list) and value and all(isinstance(v, float) and v == 1.0 for v in value):
        return [0.75 + 0.5 * (i % 2) for i in range(len(value))]
    return None


def _is_noise(key: str, value: Any) -> bool:
    return bool(_NOISE.search(key)) and isinstance(value, (int, float)) and not isinstance(value, bool) and value != 0


def zeroed_noise(model_type: str) -> list[str]:
    """The training-time noise fields (``router_jitter_noise``) the architecture's
    defaults set and the tiny folder sets to 0: what the matrix row notes."""
    from transformers import AutoConfig

    return sorted(k for k, v in AutoConfig.for_model(model_type).to_dict().items() if _is_noise(k, v))


def _resize(values: list[Any], n: int) -> list[Any]:
    """``n`` entries of a per-layer list: one of each distinct value first (in order)."""
    out: list[Any] = []
    for v in values:
        if v not in out and len(out) < n:
            out.append(v)
    rest = iter(values)
    while len(out) < n:
        out.append(next(rest, values[-1]))
    return out


def _overrides(default: Any) -> dict[str, Any]:
    values = default.to_dict()
    known = set(values) | set(getattr(default, "attribute_map", {}))
    out: dict[str, Any] = {k: v for k, v in SIZES.items() if (k in known or hasattr(default, k))
                           and getattr(getattr(type(default), k, None), "fset", True) is not None}  # no read-only properties
    vocab = SIZES["vocab_size"]
    for key, value in values.items():
        if _DROPOUT.search(key) and isinstance(value, float):
            out[key] = 0.0
        elif _is_noise(key, value):
            out[key] = 0.0
        elif _SCALE.search(key) and (fixed := _nontrivial(key, value)) is not None:
            out[key] = fixed
        elif key.endswith("_token_id") and key not in _TOKENS:
            if isinstance(value, int) and value >= vocab:
                out[key] = 3
            elif isinstance(value, list):
                out[key] = [3 + i % 8 for i in range(len(value))]
    for key, token in _TOKENS.items():
        if key in known:
            out[key] = token
    if "mlp_only_layers" in values:
        out["mlp_only_layers"] = []
    if "kv_lora_rank" in known:  # multi-head latent attention: rotary on qk_rope_head_dim, one key per head
        out.update(num_key_value_heads=out.get("num_attention_heads", 4))
        if "head_dim" in out:
            out["head_dim"] = SIZES["qk_rope_head_dim"]
    return out


def _per_layer_lists(default: Any, n: int) -> dict[str, Any]:
    """Lists as long as the default's layer count, cut to ``n`` (``layer_types`` ...);
    lists of layer indices keep the indices below ``n``."""
    layers = getattr(default, "num_hidden_layers", None)
    out: dict[str, Any] = {}
    for key, value in default.to_dict().items():
        if not isinstance(value, list) or not value or key.endswith("_token_id"):
            continue
        if layers and len(value) == layers:
            out[key] = _resize(value, n)
        elif key.endswith("_layers") and all(isinstance(v, int) for v in value):
            out[key] = [v for v in value if v < n]
    return out


def tiny_config(model_type: str) -> Any:
    """transformers' config for ``model_type``, shrunk (see the module's docstring)."""
    from transformers import AutoConfig

    default = AutoConfig.for_model(model_type)
    kwargs = _overrides(default)
    n = SIZES["num_hidden_layers"]
    lists = _per_layer_lists(default, n)
    attempts = [kwargs, {**kwargs, **lists}]  # the config recomputes its per-layer lists where it can
    # a validator refusing one override (a fixed top-k, a head_dim tied to others): without it
    attempts += [{k: v for k, v in {**kwargs, **lists}.items() if k != drop} for drop in kwargs if drop not in _CORE]
    error: Exception | None = None
    for attempt in attempts:
        try:
            config = AutoConfig.for_model(model_type, **attempt)
            break
        except Exception as exc:  # noqa: BLE001 - the first attempt's error is the one reported
            error = error or exc
    else:
        raise error  # type: ignore[misc]
    for key, value in _per_layer_lists(default, n).items():  # any the constructor kept at full length
        current = getattr(config, key, None)
        if isinstance(current, list) and len(current) == getattr(default, "num_hidden_layers", -1) != n:
            setattr(config, key, value)
    _shrink_sub_configs(config)
    return config


def _shrink_sub_configs(config: Any, depth: int = 2) -> None:
    """The text / vision / audio configs a composite config holds, shrunk in place."""
    from transformers import PreTrainedConfig

    for key in getattr(config, "sub_configs", None) or {}:
        sub = getattr(config, key, None)
        if not isinstance(sub, PreTrainedConfig):
            continue
        lists = _per_layer_lists(sub, SIZES["num_hidden_layers"])
        for name, value in {**_overrides(sub), **lists}.items():
            try:
                setattr(sub, name, value)
            except Exception:  # noqa: BLE001, S112 - a read-only or validated field keeps its default
                continue
        if depth > 1:
            _shrink_sub_configs(sub, depth - 1)


def tiny_folder(model_type: str, folder: str | Path, *, seed: int = 0, std: float = 0.2) -> Path:
    """Write a tiny random ``model_type`` folder with ``save_pretrained``; returns it."""
    from transformers import AutoModelForCausalLM

    config = tiny_config(model_type)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, std)
            else:  # norm weights, biases, scalars: around what the architecture initialises
                p.add_(torch.randn_like(p) * std)
        for module in model.modules():  # padding rows stay zero, as initialised (Youtu's from_pretrained
            if isinstance(module, torch.nn.Embedding) and module.padding_idx is not None:  # zeroes them anyway)
                module.weight[module.padding_idx].zero_()
    folder = Path(folder)
    model.save_pretrained(folder)
    return folder
