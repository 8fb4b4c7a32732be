"""Llama 4 ``config.json`` <-> ``Llama4Config`` (transformers 5.x names).

Torch-free. Reads a ``Llama4TextConfig`` (``model_type`` ``llama4_text``) or the
``text_config`` of a multimodal ``Llama4Config`` (``llama4``; the vision tower is not
loaded). A field absent from config.json means transformers' default, as it would for
transformers. Declared with the core's ``HFConfigMap`` (``MAP``): every field is
mapped, known to change nothing this model computes (``no_effect``), checked to hold
the one value implemented (``fixed``), or mapped by hand (sizes, RoPE, NoPE and MoE
layer placement); anything else is a ``ConfigError`` naming the field.
"""

from __future__ import annotations

from typing import Any

from titan_llama4.config import FLAVORS, Llama4Config
from titan_plugins.components.moe.config import MoEConfig
from titan_plugins.errors import ConfigError
from titan_plugins.hf.config import Field, HFConfigMap, rope_from_hf

__all__ = ["config_from_hf", "config_to_hf"]

# Llama4TextConfig's defaults (transformers 5.x) for the fields that change the model.
_HF_DEFAULTS: dict[str, Any] = {
    "vocab_size": 202048, "hidden_size": 5120, "intermediate_size": 8192, "intermediate_size_mlp": 16384,
    "num_hidden_layers": 48, "num_attention_heads": 40, "num_key_value_heads": 8, "head_dim": 128,
    "rms_norm_eps": 1e-5, "eos_token_id": 2, "tie_word_embeddings": False, "num_experts_per_tok": 1,
    "num_local_experts": 16, "moe_layers": None, "interleave_moe_layer_step": 1, "use_qk_norm": True,
    "no_rope_layers": None, "no_rope_layer_interval": 4, "attention_chunk_size": 8192, "layer_types": None,
    "attn_temperature_tuning": True, "floor_scale": 8192, "attn_scale": 0.1, "rope_parameters": None,
}
_DEFAULT_THETA = 500000.0
MAP = HFConfigMap(
    "llama4",
    fields=[
        Field("vocab_size", "vocab_size"), Field("hidden_size", "dim"), Field("num_hidden_layers", "n_layers"),
        Field("num_attention_heads", "n_heads"), Field("rms_norm_eps", "norm_eps", float),
        Field("use_qk_norm", "qk_norm", bool), Field("attn_temperature_tuning", "attn_temperature_tuning", bool),
        Field("floor_scale", "floor_scale"), Field("attn_scale", "attn_scale", float),
        Field("num_local_experts", "moe.num_experts"), Field("num_experts_per_tok", "moe.top_k"),
    ],
    fixed={"hidden_act": "silu", "attention_bias": False, "attention_dropout": 0.0, "output_router_logits": False,
           "tie_word_embeddings": False},
    no_effect={
        "max_position_embeddings",  # no effect on default/llama3 RoPE; model.max_seq_len is the cache length
        "router_aux_loss_coef",  # HF adds this loss only with output_router_logits (checked false)
        "router_jitter_noise",  # HF's Llama 4 router never reads it
        "for_llm_compressor",  # a quantisation tool's flag in Meta's published config.json
    },
    hf_defaults=_HF_DEFAULTS,
)
# The multimodal wrapper's own fields (the text model is text_config).
_OUTER = {"text_config", "vision_config", "boi_token_index", "eoi_token_index", "image_token_index",
          "tie_word_embeddings"}
# Hugging Face Llama 4 routing, in our MoE's terms: sigmoid of the top-k logits scales
# the expert inputs; one shared expert of the routed experts' size; no normalisation.
_ROUTING = {"num_shared_experts": 1, "score_func": "sigmoid", "route_norm": False, "route_scale": 1.0,
            "score_before_experts": True, "num_expert_groups": None, "num_limited_groups": None}
# TorchTitan's sizing knobs of the shipped flavors: config.json's sizes are expressed
# through these where one of them gives both (so the flavors map back to themselves).
_SIZING = sorted({(f.multiple_of, f.ffn_dim_multiplier, f.auto_scale_hidden_dim) for f in FLAVORS.values()},
                 key=str)

# Training settings no config.json field carries (Llama 4's router has no bias): a model
# loaded from a folder trains without them unless set explicitly, and the export refuses a
# bias they trained. The conformance kit's round trip skips them.
HF_TRAINING_ONLY = ("moe.load_balance_coeff",)


def _bad(field: str, value: Any, why: str) -> ConfigError:
    return ConfigError(f"config.json: {field}={value!r}: {why}")


def _text_config(hf: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """``(text fields, prefix for error names)``; checks the multimodal wrapper."""
    model_type = hf.get("model_type")
    if model_type == "llama4_text":
        return hf, ""
    if model_type != "llama4":
        raise _bad("model_type", model_type, "the llama4 plugin reads llama4_text and llama4")
    unknown = sorted(set(hf) - _OUTER - MAP.no_effect)
    if unknown:
        raise _bad(unknown[0], hf[unknown[0]], "not understood by the llama4 plugin (it would be dropped)")
    if hf.get("tie_word_embeddings"):
        raise _bad("tie_word_embeddings", True, "the llama4 plugin has no tied output weight")
    text = hf.get("text_config")
    if not isinstance(text, dict):
        raise _bad("text_config", text, "a llama4 config.json needs its text_config")
    return text, "text_config."


def _sizes(dim: int, top_k: int, dense: int, expert: int) -> dict[str, Any]:
    for multiple_of, multiplier, auto_scale in _SIZING:
        probe = Llama4Config(dim=dim, multiple_of=multiple_of, ffn_dim_multiplier=multiplier,
                             auto_scale_hidden_dim=auto_scale, moe=MoEConfig(top_k=top_k, num_shared_experts=1))
        if (probe.ffn_hidden_dim, probe.moe_hidden_dim) == (dense, expert):
            return {"multiple_of": multiple_of, "ffn_dim_multiplier": multiplier,
                    "auto_scale_hidden_dim": auto_scale, "hidden_dim": None, "moe_inter_dim": None}
    return {"hidden_dim": dense, "moe_inter_dim": expert}


def _rope(hf: dict[str, Any], name: str) -> dict[str, Any]:
    return rope_from_hf(hf, default_theta=_DEFAULT_THETA, plugin="llama4", prefix=name)


def config_from_hf(hf_config: dict[str, Any]) -> dict[str, Any]:
    """Values for ``Llama4Config`` from a Llama 4 config.json."""
    text, name = _text_config(hf_config)
    try:
        out, used = MAP.read(text)
        hf = {**_HF_DEFAULTS, **text}
        MAP.finish(hf, used | {"num_key_value_heads", "head_dim", "eos_token_id", "intermediate_size",
                               "intermediate_size_mlp", "moe_layers", "interleave_moe_layer_step",
                               "no_rope_layers", "no_rope_layer_interval", "attention_chunk_size",
                               "layer_types", "rope_parameters", "rope_theta", "rope_scaling"}, out)
    except ConfigError as exc:  # name the field inside text_config
        raise ConfigError(str(exc).replace("config.json: ", f"config.json: {name}", 1)) from None

    n, dim, heads = out["n_layers"], out["dim"], out["n_heads"]
    kv_heads = int(hf["num_key_value_heads"] or heads)
    if hf["head_dim"] is not None and int(hf["head_dim"]) * heads != dim:
        raise _bad(name + "head_dim", hf["head_dim"],
                   f"the llama4 plugin's head_dim is hidden_size / num_attention_heads = {dim // heads}")
    eos = hf["eos_token_id"]
    eos = eos[0] if isinstance(eos, list) and eos else eos
    top_k = out["moe"]["top_k"]
    # Llama 4's router has no bias: train none (load balancing would add one)
    out["moe"].update(_ROUTING, load_balance_coeff=None)
    out.update(n_kv_heads=None if kv_heads == heads else kv_heads, **_rope(hf, name),
               **_sizes(dim, top_k, int(hf["intermediate_size_mlp"]), int(hf["intermediate_size"])))
    if eos is not None:
        out["eos_id"] = int(eos)

    step = int(hf["interleave_moe_layer_step"])
    moe_layers = hf["moe_layers"]
    if moe_layers is None or sorted(moe_layers) == list(range(step - 1, n, max(step, 1))):
        out.update(interleave_moe_layer_step=step, moe_layers=None)
    else:
        out["moe_layers"] = sorted(int(i) for i in moe_layers)

    # no_rope_layers: 1 = RoPE, 0 = NoPE; empty or absent means HF's default placement.
    rope_flags = hf["no_rope_layers"] or [int((i + 1) % int(hf["no_rope_layer_interval"]) != 0) for i in range(n)]
    if len(rope_flags) < n:
        raise _bad(name + "no_rope_layers", rope_flags, f"needs an entry for each of the {n} layers")
    chunk = hf["attention_chunk_size"]
    nope = [i for i in range(n) if not rope_flags[i]]
    if nope or chunk is not None:
        out.update(every_n_layers_nope=None, nope_layers=nope,
                   fixed_attn_block_size=None if chunk is None else int(chunk))
    else:
        out.update(every_n_layers_nope=None, nope_layers=None)
    kinds = ["chunked_attention" if rope_flags[i] and chunk is not None else "full_attention" for i in range(n)]
    for i, kind in enumerate(hf["layer_types"] or kinds):
        if i < n and kind != kinds[i]:
            raise _bad(f"{name}layer_types[{i}]", kind,
                       f"the llama4 plugin gives this layer {kinds[i]} (chunked exactly on RoPE layers)")
    return out


def config_to_hf(config: Llama4Config) -> dict[str, Any]:
    """A config.json that ``transformers`` loads as ``Llama4ForCausalLM`` (text only)."""
    c = config
    moe_layers = [i for i in range(c.n_layers) if c.is_moe_layer(i)]
    if moe_layers:
        routing = {k: getattr(c.moe, k) for k in _ROUTING}
        routing["score_func"] = c.moe.score_func.value
        if routing != _ROUTING:
            key = next(k for k in _ROUTING if routing[k] != _ROUTING[k])
            raise ConfigError(
                f"model.moe.{key}={routing[key]!r} has no Hugging Face Llama 4 equivalent "
                f"(its routing: {_ROUTING[key]!r})"
            )
    chunks = [c.attn_chunk_size(i) for i in range(c.n_layers)]
    chunk = next((x for x in chunks if x is not None), None)
    return {
        "architectures": ["Llama4ForCausalLM"],
        "model_type": "llama4_text",
        **MAP.write(c),
        "intermediate_size": c.moe_hidden_dim,
        "intermediate_size_mlp": c.ffn_hidden_dim,
        "num_key_value_heads": c.kv_heads,
        "head_dim": c.head_dim,
        "max_position_embeddings": c.max_seq_len,
        "rope_parameters": _rope_to_hf(c),
        "interleave_moe_layer_step": c.interleave_moe_layer_step,
        "moe_layers": moe_layers,
        "no_rope_layers": [int(c.uses_rope(i)) for i in range(c.n_layers)],
        "attention_chunk_size": chunk,
        "layer_types": ["full_attention" if x is None else "chunked_attention" for x in chunks],
        "eos_token_id": c.eos_id,
        "dtype": "float32",
    }


def _rope_to_hf(c: Llama4Config) -> dict[str, Any]:
    s = c.rope_scaling
    if not s.enabled:
        return {"rope_type": "default", "rope_theta": c.rope_theta}
    return {"rope_type": "llama3", "rope_theta": c.rope_theta, "factor": s.scaling_factor,
            "low_freq_factor": s.low_freq_factor, "high_freq_factor": s.high_freq_factor,
            "original_max_position_embeddings": s.original_max_position_embeddings}
