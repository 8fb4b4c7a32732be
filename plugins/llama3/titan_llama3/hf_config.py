"""Llama ``config.json`` (``LlamaForCausalLM``, transformers 4.x and 5.x) <-> ``Llama3Config``.

Torch-free. Declared with the core's ``HFConfigMap``: every config.json field is either
mapped (``Field``), known to have no effect on the weights or the forward pass (its
``no_effect``), or checked to hold the one value this model implements (``fixed``);
RoPE (``rope_parameters`` of transformers 5 or ``rope_scaling`` + ``rope_theta`` of 4.x,
``rope_type`` ``default`` or ``llama3``), the derived sizes and ``eos_token_id`` are
mapped by hand; anything else is a ``ConfigError`` naming the field.
"""

from __future__ import annotations

from typing import Any

from titan_llama3.config import FLAVORS, Llama3Config
from titan_plugins.errors import ConfigError
from titan_plugins.hf.config import Field, HFConfigMap, rope_from_hf

__all__ = ["config_from_hf", "config_to_hf"]

_ARCH = "LlamaForCausalLM"
_DEFAULT_THETA = 10000.0  # transformers' LlamaConfig default

MAP = HFConfigMap(
    "llama3",
    fields=[
        Field("hidden_size", "dim"), Field("num_hidden_layers", "n_layers"),
        Field("num_attention_heads", "n_heads"), Field("num_key_value_heads", "n_kv_heads"),
        Field("head_dim", "head_dim"), Field("vocab_size", "vocab_size"),
        Field("intermediate_size", "hidden_dim"), Field("rms_norm_eps", "norm_eps", float),
        Field("max_position_embeddings", "max_seq_len"),
        Field("tie_word_embeddings", "enable_weight_tying", bool),
        Field("attention_bias", "attention_bias", bool),
    ],
    # mlp_bias: the shared SwiGLU (titan_plugins.components.feed_forward) has no biases
    fixed={"hidden_act": "silu", "attention_dropout": 0.0, "mlp_bias": False},
    no_effect={"pretraining_tp"},  # transformers 4.x splits the projections into slices: the same sums
)

# TorchTitan's sizing knobs of the shipped flavors: an intermediate_size one of them
# derives is expressed through it (so the flavors map back to themselves).
_SIZING = sorted({(f.multiple_of, f.ffn_dim_multiplier) for f in FLAVORS.values()},
                 key=lambda s: (s[1] is not None, str(s)))  # TorchTitan's default (no multiplier) first


def _bad(field: str, value: Any, why: str) -> ConfigError:
    return MAP.bad(field, value, why)


def _rope(hf: dict[str, Any]) -> dict[str, Any]:
    return rope_from_hf(hf, default_theta=_DEFAULT_THETA, plugin="llama3")


def config_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    """Values for ``Llama3Config`` from a Llama config.json."""
    if hf.get("model_type") != "llama":
        raise _bad("model_type", hf.get("model_type"), "the llama3 plugin reads model_type 'llama'")
    for arch in hf.get("architectures") or []:
        if arch != _ARCH:
            raise _bad("architectures", hf["architectures"], f"the llama3 plugin reads {_ARCH}")
    out, used = MAP.read(hf)
    used |= {"rope_parameters", "rope_scaling", "rope_theta"}
    out.update(_rope(hf))
    # Values our defaults derive map to None (the same model, and the flavors round-trip).
    if "n_heads" in out and out.get("n_kv_heads") == out["n_heads"]:
        out["n_kv_heads"] = None
    if "dim" in out and "n_heads" in out and out.get("head_dim") == out["dim"] // out["n_heads"]:
        out["head_dim"] = None
    if "dim" in out and out.get("hidden_dim") is not None:
        for multiple_of, multiplier in _SIZING:
            probe = Llama3Config(dim=out["dim"], multiple_of=multiple_of, ffn_dim_multiplier=multiplier)
            if probe.ffn_hidden_dim == out["hidden_dim"]:
                out.update(multiple_of=multiple_of, ffn_dim_multiplier=multiplier, hidden_dim=None)
                break
    eos = hf.get("eos_token_id")
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    if eos is not None:
        out["eos_id"] = int(eos)
    return MAP.finish(hf, used, out)


def config_to_hf(config: Llama3Config) -> dict[str, Any]:
    """A config.json that ``transformers`` loads as ``LlamaForCausalLM``."""
    c = config
    s = c.rope_scaling
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": c.rope_theta}
    if s.enabled:
        rope = {"rope_type": "llama3", "rope_theta": c.rope_theta, "factor": s.scaling_factor,
                "low_freq_factor": s.low_freq_factor, "high_freq_factor": s.high_freq_factor,
                "original_max_position_embeddings": s.original_max_position_embeddings}
    return {
        "architectures": [_ARCH],
        "model_type": "llama",
        **MAP.write(c),
        # the sizes our defaults derive, written out
        "num_key_value_heads": c.kv_heads, "head_dim": c.head_size, "intermediate_size": c.ffn_hidden_dim,
        "rope_parameters": rope,
        "eos_token_id": c.eos_id,
        "dtype": "float32",
    }
