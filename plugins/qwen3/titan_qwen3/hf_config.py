"""Qwen3 / Qwen3-MoE ``config.json`` <-> ``Qwen3Config`` (transformers 5.x names).

Torch-free. Every config.json field is either mapped, known to have no effect on
the weights or the forward pass (``_NO_EFFECT``), or checked to hold the one value
this model implements; anything else is a ``ConfigError`` naming the field.
"""

from __future__ import annotations

from typing import Any

from titan_plugins.errors import ConfigError
from titan_qwen3.config import Qwen3Config

__all__ = ["config_from_hf", "config_to_hf"]

_ARCHS = {"qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}

# Bookkeeping, generation or initialisation settings: nothing the loaded model computes.
_NO_EFFECT = {
    "architectures", "model_type", "transformers_version", "dtype", "torch_dtype", "_name_or_path",
    "output_hidden_states", "output_attentions", "return_dict", "chunk_size_feed_forward",
    "is_encoder_decoder", "id2label", "label2id", "problem_type", "use_cache", "initializer_range",
    "pad_token_id", "bos_token_id", "max_window_layers", "sliding_window",
    "router_aux_loss_coef",  # HF adds this loss only with output_router_logits (checked false)
}
# field -> the only value implemented (None: absent is fine too)
_FIXED: dict[str, Any] = {
    "hidden_act": "silu",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "use_sliding_window": False,
    "output_router_logits": False,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
}


def _bad(field: str, value: Any, why: str) -> ConfigError:
    return ConfigError(f"config.json: {field}={value!r}: {why}")


def config_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    """Values for ``Qwen3Config`` from a Qwen3 or Qwen3-MoE config.json."""
    model_type = hf.get("model_type")
    if model_type not in _ARCHS:
        raise _bad("model_type", model_type, "the qwen3 plugin reads qwen3 and qwen3_moe")
    moe = model_type == "qwen3_moe"
    out: dict[str, Any] = {}
    used = set(_NO_EFFECT) | set(_FIXED)
    for field, value in _FIXED.items():
        if field in hf and hf[field] is not None and hf[field] != value:
            raise _bad(field, hf[field], f"the qwen3 plugin implements only {value!r}")

    def take(field: str, ours: str, cast: Any = int) -> None:
        used.add(field)
        if hf.get(field) is not None:
            out[ours] = cast(hf[field])

    take("hidden_size", "dim")
    take("num_hidden_layers", "n_layers")
    take("num_attention_heads", "n_heads")
    take("num_key_value_heads", "n_kv_heads")
    take("vocab_size", "vocab_size")
    take("intermediate_size", "hidden_dim")
    take("rms_norm_eps", "norm_eps", float)
    take("max_position_embeddings", "max_seq_len")
    take("tie_word_embeddings", "enable_weight_tying", bool)
    used.add("head_dim")
    if hf.get("head_dim") is not None:
        out["head_dim"] = int(hf["head_dim"])
    elif "hidden_size" in hf and "num_attention_heads" in hf:
        out["head_dim"] = int(hf["hidden_size"]) // int(hf["num_attention_heads"])

    rope = dict(hf.get("rope_parameters") or {})
    used.update({"rope_parameters", "rope_theta", "rope_scaling"})
    if hf.get("rope_scaling"):
        raise _bad("rope_scaling", hf["rope_scaling"], "the qwen3 plugin implements plain RoPE only")
    rope_type = rope.pop("rope_type", "default")
    if rope_type != "default":
        raise _bad("rope_parameters.rope_type", rope_type, "the qwen3 plugin implements plain RoPE only")
    theta = rope.pop("rope_theta", hf.get("rope_theta"))
    if theta is not None:
        out["rope_theta"] = float(theta)
    if rope:
        key = next(iter(rope))
        raise _bad(f"rope_parameters.{key}", rope[key], "not implemented by the qwen3 plugin")

    used.add("layer_types")
    for i, kind in enumerate(hf.get("layer_types") or []):
        if kind != "full_attention":
            raise _bad(f"layer_types[{i}]", kind, "the qwen3 plugin implements full attention only")

    used.add("eos_token_id")
    eos = hf.get("eos_token_id")
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    if eos is not None:
        out["eos_id"] = int(eos)

    out["moe_enabled"] = moe
    if moe:
        used.update({"moe_intermediate_size", "num_experts", "num_local_experts", "num_experts_per_tok",
                     "norm_topk_prob"})
        experts = hf.get("num_experts", hf.get("num_local_experts"))
        moe_values: dict[str, Any] = {
            "num_shared_experts": 0, "score_func": "softmax", "route_scale": 1.0,
            "score_before_experts": False, "num_expert_groups": None, "num_limited_groups": None,
            "route_norm": bool(hf.get("norm_topk_prob", False)),
        }
        if experts is not None:
            moe_values["num_experts"] = int(experts)
        if hf.get("num_experts_per_tok") is not None:
            moe_values["top_k"] = int(hf["num_experts_per_tok"])
        if hf.get("moe_intermediate_size") is not None:
            out["moe_inter_dim"] = int(hf["moe_intermediate_size"])
        out["moe"] = moe_values

    unknown = sorted(set(hf) - used)
    if unknown:
        field = unknown[0]
        raise _bad(field, hf[field], "not understood by the qwen3 plugin (it would be dropped)")
    return out


def config_to_hf(config: Qwen3Config) -> dict[str, Any]:
    """A config.json that ``transformers`` loads as Qwen3ForCausalLM / Qwen3MoeForCausalLM."""
    c = config
    model_type = "qwen3_moe" if c.moe_enabled else "qwen3"
    hf: dict[str, Any] = {
        "architectures": [_ARCHS[model_type]],
        "model_type": model_type,
        "vocab_size": c.vocab_size,
        "hidden_size": c.dim,
        "intermediate_size": c.hidden_dim,
        "num_hidden_layers": c.n_layers,
        "num_attention_heads": c.n_heads,
        "num_key_value_heads": c.n_kv_heads,
        "head_dim": c.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": c.max_seq_len,
        "rms_norm_eps": c.norm_eps,
        "tie_word_embeddings": bool(c.enable_weight_tying),
        "rope_parameters": {"rope_type": "default", "rope_theta": c.rope_theta},
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "eos_token_id": c.eos_id,
        "dtype": "float32",
    }
    if not c.qk_norm:
        raise ConfigError("model.qk_norm=false has no Hugging Face Qwen3 equivalent (Qwen3 always uses qk-norm)")
    if c.moe_enabled:
        m = c.moe
        if m.num_shared_experts or m.score_func.value != "softmax" or m.score_before_experts \
                or m.route_scale != 1.0 or m.num_expert_groups:
            raise ConfigError(
                "model.moe: only Qwen3-MoE routing (softmax, no shared experts, scores after the "
                "experts, route_scale 1, no groups) has a Hugging Face equivalent"
            )
        hf.update({
            "moe_intermediate_size": c.moe_inter_dim,
            "num_experts": m.num_experts,
            "num_experts_per_tok": m.top_k,
            "norm_topk_prob": bool(m.route_norm),
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
        })
    return hf
