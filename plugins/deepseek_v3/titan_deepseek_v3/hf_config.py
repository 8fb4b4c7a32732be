"""DeepSeek-V3 ``config.json`` <-> ``DeepSeekV3Config`` (transformers 5.x names; the
original remote-code names where they differ).

Torch-free. Declared with the core's ``HFConfigMap`` (``MAP``): every config.json field
is either mapped, known to have no effect on the weights or the forward pass
(``no_effect``), or checked to hold the one value this model implements (``fixed``);
RoPE, expert groups and norms are mapped by hand; anything else is a ``ConfigError``
naming the field.
The facts follow transformers' ``modeling_deepseek_v3.py``: sigmoid router scores
plus ``e_score_correction_bias`` (our ``moe.expert_bias``) for the choice, grouped
top-k (top-2 sums per group), ``norm_topk_prob``, ``routed_scaling_factor``,
``kv_a_layernorm`` / ``q_a_layernorm`` at eps 1e-6, the final norm at
``rms_norm_eps``, and YaRN whenever ``rope_type`` is ``yarn`` (cos/sin scaled by its
``attention_factor``, the softmax by ``mscale_all_dim``).
"""

from __future__ import annotations

import math
from typing import Any

from titan_deepseek_v3.config import DeepSeekV3Config, RopeScaling
from titan_plugins.errors import ConfigError
from titan_plugins.hf.config import Field, HFConfigMap

__all__ = ["config_from_hf", "config_to_hf"]

HF_LATENT_EPS = 1e-6  # DeepseekV3RMSNorm's default, used by q_a_layernorm and kv_a_layernorm
# remote-code names of what transformers hard-codes: checked on read, never written
_REMOTE_FIXED = {"output_router_logits": False, "scoring_func": "sigmoid", "topk_method": "noaux_tc",
                 "moe_layer_freq": 1}

# transformers 5's DeepseekV3Config defaults: a field absent from config.json means these
# (not the flavor's value), as it does for DeepseekV3ForCausalLM.
_HF_DEFAULTS: dict[str, Any] = {
    "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
    "num_hidden_layers": 61, "num_attention_heads": 128, "n_shared_experts": 1, "n_routed_experts": 256,
    "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64,
    "v_head_dim": 128, "qk_nope_head_dim": 128, "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8,
    "first_k_dense_replace": 3, "norm_topk_prob": True, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
}
_A, _M = "layer.attention.", "layer.moe."
MAP = HFConfigMap(
    "deepseek_v3",
    fields=[
        Field("vocab_size", "vocab_size"), Field("hidden_size", "dim"), Field("num_hidden_layers", "n_layers"),
        Field("first_k_dense_replace", "n_dense_layers"), Field("max_position_embeddings", "max_seq_len"),
        Field("num_attention_heads", _A + "n_heads"), Field("kv_lora_rank", _A + "kv_lora_rank"),
        Field("qk_nope_head_dim", _A + "qk_nope_head_dim"), Field("qk_rope_head_dim", _A + "qk_rope_head_dim"),
        Field("v_head_dim", _A + "v_head_dim"), Field("intermediate_size", "layer.ffn.hidden_dim"),
        Field("moe_intermediate_size", _M + "hidden_dim"), Field("n_routed_experts", _M + "num_experts"),
        Field("n_shared_experts", _M + "num_shared_experts"), Field("num_experts_per_tok", _M + "top_k"),
        Field("norm_topk_prob", _M + "route_norm", bool, bool),
        Field("routed_scaling_factor", _M + "route_scale", float, float),
    ],
    fixed={"hidden_act": "silu", "attention_bias": False, "attention_dropout": 0.0, "rope_interleave": True,
           "tie_word_embeddings": False, **_REMOTE_FIXED},
    no_effect={"pretraining_tp", "auto_map", "ep_size",
               # the multi-token-prediction layers sit past num_hidden_layers; from_hf skips them
               "num_nextn_predict_layers", "num_mtp_layers",
               # sequence-wise aux loss of the original training code: transformers' forward ignores it
               "aux_loss_alpha", "seq_aux"},
    hf_defaults=_HF_DEFAULTS,
)
_ROPE_KEYS = {"rope_type", "type", "rope_theta", "factor", "original_max_position_embeddings", "beta_fast",
              "beta_slow", "mscale", "mscale_all_dim", "attention_factor", "truncate"}


def _bad(field: str, value: Any, why: str) -> ConfigError:
    return ConfigError(f"config.json: {field}={value!r}: {why}")


def _int(field: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int | float) or int(value) != value:
        raise _bad(field, value, "must be an integer")
    return int(value)


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _rope_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    """``layer.rope`` values from ``rope_parameters`` (or legacy ``rope_scaling`` + ``rope_theta``)."""
    key = "rope_parameters" if hf.get("rope_parameters") else "rope_scaling"
    rope = dict(hf.get(key) or {})
    unknown = sorted(set(rope) - _ROPE_KEYS)
    if unknown:
        raise _bad(f"{key}.{unknown[0]}", rope[unknown[0]], "not understood by the deepseek_v3 plugin")
    out: dict[str, Any] = {}
    theta = rope.get("rope_theta", hf.get("rope_theta"))
    if theta is not None:
        out["theta"] = float(theta)
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        out["scaling"] = RopeScaling.none.value
        return out
    if kind != "yarn":
        raise _bad(f"{key}.rope_type", kind, "the deepseek_v3 plugin implements plain RoPE and YaRN only")
    if rope.get("truncate", True) is not True:
        raise _bad(f"{key}.truncate", rope["truncate"], "the deepseek_v3 plugin implements truncate=true only")
    original = rope.get("original_max_position_embeddings")
    if original is None:
        raise _bad(f"{key}.original_max_position_embeddings", None, "YaRN needs it")
    factor = rope.get("factor")
    if factor is None:  # transformers: the ratio of the two context lengths
        factor = hf["max_position_embeddings"] / original
    if factor < 1:
        raise _bad(f"{key}.factor", factor, "YaRN needs factor >= 1")
    mscale, mscale_all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
    attention_factor = rope.get("attention_factor")
    if attention_factor is None:  # transformers' _compute_yarn_parameters
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)
    out.update(
        scaling=RopeScaling.yarn.value,
        factor=float(factor),
        original_seq_len=_int(f"{key}.original_max_position_embeddings", original),
        beta_fast=_int(f"{key}.beta_fast", rope.get("beta_fast") or 32),
        beta_slow=_int(f"{key}.beta_slow", rope.get("beta_slow") or 1),
        mscale=float(mscale_all_dim or 0.0),  # the softmax scale's mscale
        attention_factor=float(attention_factor),
    )
    return out


def config_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    """Values for ``DeepSeekV3Config`` from a DeepSeek-V3 config.json (every field the
    model depends on: absent ones take transformers' defaults, as they would there)."""
    if hf.get("model_type") != "deepseek_v3":
        raise _bad("model_type", hf.get("model_type"), "the deepseek_v3 plugin reads deepseek_v3 only")
    if hf.get("tie_word_embeddings"):
        raise _bad("tie_word_embeddings", True, "the deepseek_v3 plugin has an untied lm_head only")
    if hf.get("quantization_config"):
        raise _bad("quantization_config", hf["quantization_config"], "dequantize the checkpoint first")
    heads = hf.get("num_attention_heads")
    kv_heads = hf.get("num_key_value_heads")
    if kv_heads is not None and heads is not None and kv_heads != heads:
        raise _bad("num_key_value_heads", kv_heads, f"MLA expands kv to every head: must be num_attention_heads={heads}")
    n_shared = hf.get("n_shared_experts")
    if n_shared is not None and n_shared < 1:
        raise _bad("n_shared_experts", n_shared, "the deepseek_v3 plugin needs at least one shared expert")
    out, used = MAP.read(hf)
    hf = {**_HF_DEFAULTS, **hf}
    used |= {"quantization_config", "num_key_value_heads", "rope_parameters", "rope_scaling", "rope_theta",
             "q_lora_rank", "n_group", "topk_group", "head_dim", "qk_head_dim"}
    layer = out.setdefault("layer", {})
    layer.setdefault("attention", {})["q_lora_rank"] = _int("q_lora_rank", hf["q_lora_rank"] or 0)  # null: full-rank
    moe = layer.setdefault("moe", {})
    moe.update(score_func="sigmoid", score_before_experts=False)
    groups = hf.get("n_group") or 1
    if groups > 1:
        moe["num_expert_groups"] = _int("n_group", groups)
        moe["num_limited_groups"] = _int("topk_group", hf.get("topk_group") or 1)
    else:  # one group: transformers' group limit keeps everything
        moe["num_expert_groups"] = moe["num_limited_groups"] = None

    # derived by transformers; they must agree with what they derive from
    rope_dim, nope_dim = hf.get("qk_rope_head_dim"), hf.get("qk_nope_head_dim")
    for field, want in (("head_dim", rope_dim), ("qk_head_dim", None if rope_dim is None or nope_dim is None
                                                 else rope_dim + nope_dim)):
        if hf.get(field) is not None and want is not None and hf[field] != want:
            raise _bad(field, hf[field], f"transformers derives {want} from the head dims")

    layer["norm"] = {"latent_eps": HF_LATENT_EPS}
    used.add("rms_norm_eps")
    if hf.get("rms_norm_eps") is not None:
        layer["norm"]["eps"] = layer["norm"]["final_eps"] = float(hf["rms_norm_eps"])
    layer["rope"] = _rope_from_hf(hf)
    return MAP.finish(hf, used, out)


def _not_hf(key: str, value: Any, why: str) -> ConfigError:
    return ConfigError(f"model.{key}={value!r} has no Hugging Face DeepSeek-V3 equivalent ({why})")


def config_to_hf(config: DeepSeekV3Config) -> dict[str, Any]:
    """A config.json that ``transformers`` loads as ``DeepseekV3ForCausalLM``; a setting
    it cannot express is a ConfigError naming it."""
    c, layer = config, config.layer
    att, rope, norm, moe = layer.attention, layer.rope, layer.norm, layer.moe
    if getattr(moe.score_func, "value", moe.score_func) != "sigmoid":
        raise _not_hf("layer.moe.score_func", getattr(moe.score_func, "value", moe.score_func),
                      "DeepseekV3ForCausalLM routes with sigmoid scores")
    if moe.score_before_experts:
        raise _not_hf("layer.moe.score_before_experts", True, "it scales the experts' outputs")
    if moe.num_shared_experts < 1:
        raise _not_hf("layer.moe.num_shared_experts", moe.num_shared_experts, "it always has shared experts")
    if norm.latent != HF_LATENT_EPS:
        raise _not_hf("layer.norm.latent_eps", norm.latent_eps, f"its q/kv latent norms use eps {HF_LATENT_EPS}")
    if norm.final_eps != norm.eps:
        raise _not_hf("layer.norm.final_eps", norm.final_eps, f"its final norm uses rms_norm_eps={norm.eps}")
    hf: dict[str, Any] = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        **MAP.write(c),
        "num_key_value_heads": att.n_heads,
        "q_lora_rank": att.q_lora_rank or None,
        "n_group": moe.num_expert_groups or 1,
        "topk_group": moe.num_limited_groups or 1,
        "rms_norm_eps": norm.eps,
        "num_nextn_predict_layers": 0,
        "dtype": "float32",
    }
    for field in _REMOTE_FIXED:
        del hf[field]
    if not c.yarn_enabled:
        hf["rope_parameters"] = {"rope_type": "default", "rope_theta": rope.theta}
        return hf
    yarn = {
        "rope_type": "yarn", "rope_theta": rope.theta, "factor": rope.factor,
        "original_max_position_embeddings": rope.original_seq_len,
        "beta_fast": rope.beta_fast, "beta_slow": rope.beta_slow, "mscale_all_dim": rope.mscale,
    }
    if rope.attention_factor == 1.0 and rope.mscale:
        yarn["mscale"] = rope.mscale  # transformers derives attention_factor = 1 from equal mscales
    else:
        yarn["attention_factor"] = float(rope.attention_factor)
    hf["rope_parameters"] = yarn
    return hf
