"""Qwen3 / Qwen3-MoE ``config.json`` <-> ``Qwen3Config`` (transformers 5.x names).

Torch-free. Declared with the core's ``HFConfigMap``: every config.json field is
either mapped (``Field``), known to have no effect on the weights or the forward pass
(its ``no_effect``), or checked to hold the one value this model implements
(``fixed``); RoPE and the MoE routing are mapped by hand; anything else is a
``ConfigError`` naming the field.
"""

from __future__ import annotations

from typing import Any

from titan_plugins.errors import ConfigError
from titan_plugins.hf.config import Field, HFConfigMap
from titan_qwen3.config import Qwen3Config

__all__ = ["config_from_hf", "config_to_hf"]

_ARCHS = {"qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}

MAP = HFConfigMap(
    "qwen3",
    fields=[
        Field("hidden_size", "dim"), Field("num_hidden_layers", "n_layers"),
        Field("num_attention_heads", "n_heads"), Field("num_key_value_heads", "n_kv_heads"),
        Field("vocab_size", "vocab_size"), Field("intermediate_size", "hidden_dim"),
        Field("head_dim", "head_dim"), Field("rms_norm_eps", "norm_eps", float),
        Field("max_position_embeddings", "max_seq_len"),
        Field("tie_word_embeddings", "enable_weight_tying", bool),
    ],
    fixed={"hidden_act": "silu", "attention_bias": False, "attention_dropout": 0.0,
           "use_sliding_window": False, "output_router_logits": False},
    no_effect={"max_window_layers", "sliding_window",
               "router_aux_loss_coef"},  # HF adds this loss only with output_router_logits (checked false)
)


def _layer_list(value: Any) -> list[int]:
    if not isinstance(value, list) or any(isinstance(i, bool) or not isinstance(i, int) for i in value):
        raise MAP.bad("mlp_only_layers", value, "must be a list of layer indices")
    return sorted(value)


# The layer schedule (decoder_sparse_step, mlp_only_layers: which blocks are dense) maps
# to the same-named model fields; norm_topk_prob=false is route_norm=false (the top-k
# softmax scores are used as they are, as transformers does).
MOE_MAP = HFConfigMap(
    "qwen3",
    fields=[Field("moe_intermediate_size", "moe_inter_dim"), Field("num_experts", "moe.num_experts"),
            Field("num_experts_per_tok", "moe.top_k"), Field("norm_topk_prob", "moe.route_norm", bool),
            Field("decoder_sparse_step", "decoder_sparse_step"),
            Field("mlp_only_layers", "mlp_only_layers", _layer_list)],
)

# Training settings no config.json field carries (Qwen3-MoE's router has no bias): a model
# loaded from a folder trains without them unless set explicitly, and the export refuses a
# bias they trained. The conformance kit's round trip skips them.
HF_TRAINING_ONLY = ("moe.load_balance_coeff",)


def _bad(field: str, value: Any, why: str) -> ConfigError:
    return MAP.bad(field, value, why)


def config_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    """Values for ``Qwen3Config`` from a Qwen3 or Qwen3-MoE config.json."""
    model_type = hf.get("model_type")
    if model_type not in _ARCHS:
        raise _bad("model_type", model_type, "the qwen3 plugin reads qwen3 and qwen3_moe")
    moe = model_type == "qwen3_moe"
    out, used = MAP.read(hf)
    if "head_dim" not in out and "hidden_size" in hf and "num_attention_heads" in hf:
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

    eos = hf.get("eos_token_id")
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    if eos is not None:
        out["eos_id"] = int(eos)

    out["moe_enabled"] = moe
    if moe:
        moe_out, moe_used = MOE_MAP.read({"num_experts": hf.get("num_local_experts"), **hf})
        used |= moe_used | {"num_local_experts"}
        if moe_out.get("decoder_sparse_step", 1) < 1:  # transformers would divide by it
            raise _bad("decoder_sparse_step", moe_out["decoder_sparse_step"], "must be >= 1")
        for key in ("decoder_sparse_step", "mlp_only_layers"):
            if key in moe_out:
                out[key] = moe_out[key]
        # Qwen3-MoE routing in our MoE's terms. Its router has no bias, so none trains
        # (load balancing would add one that the export cannot carry).
        out["moe"] = {
            "num_shared_experts": 0, "score_func": "softmax", "route_scale": 1.0,
            "score_before_experts": False, "num_expert_groups": None,
            "num_limited_groups": None, "route_norm": False, "load_balance_coeff": None,
            **moe_out.get("moe", {}),
        }
        if "moe_inter_dim" in moe_out:
            out["moe_inter_dim"] = moe_out["moe_inter_dim"]
    return MAP.finish(hf, used, out)


def config_to_hf(config: Qwen3Config) -> dict[str, Any]:
    """A config.json that ``transformers`` loads as Qwen3ForCausalLM / Qwen3MoeForCausalLM."""
    c = config
    model_type = "qwen3_moe" if c.moe_enabled else "qwen3"
    hf: dict[str, Any] = {
        "architectures": [_ARCHS[model_type]],
        "model_type": model_type,
        **MAP.write(c),
        "rope_parameters": {"rope_type": "default", "rope_theta": c.rope_theta},
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
        hf.update(MOE_MAP.write(c))
    return hf
