"""The ``model=hf`` schema, its test flavors, and config.json <-> schema.

Torch-free and transformers-free (``titan-plugins list`` imports it). The schema types
the numbers the core and users touch (``vocab_size``, ``dim``, ``n_layers``, heads,
tying) and carries the rest of config.json unchanged in ``hf_config``; the builder hands
the two, merged, to ``AutoConfig.for_model``. One source of truth: the typed fields are
read from config.json by :func:`config_from_hf`, flavors included.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from titan_plugins.components.attention_masks import AttentionMask
from titan_plugins.errors import ConfigError

__all__ = ["FLAVORS", "TESTED", "AttnImpl", "HFModelConfig", "config_from_hf", "config_to_hf", "hf_dict"]

#: The architectures whose numerics this repository's tests hold against transformers on
#: every layout (step-1 loss within 1e-5 fp32), with their ``model_type``. Documentation
#: and ``model.verify``'s default, not a gate: any decoder-only causal LM the installed
#: transformers builds is accepted (titan_hf.architecture); docs/hf-matrix.md lists more.
TESTED: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma3ForCausalLM": "gemma3_text",
    "Phi3ForCausalLM": "phi3",
    "Olmo2ForCausalLM": "olmo2",
    "GptOssForCausalLM": "gpt_oss",
    "MixtralForCausalLM": "mixtral",
    "Qwen3MoeForCausalLM": "qwen3_moe",
}
class AttnImpl(str, Enum):
    """transformers' attention kernels that run on every device (CPU included); ``auto``:
    SDPA where the architecture has it, else eager (titan_hf.architecture)."""

    auto = "auto"
    sdpa = "sdpa"
    eager = "eager"


@dataclass(kw_only=True)
class HFModelConfig:
    """A transformers causal LM. Every field but ``attn_implementation`` comes from
    config.json (``model.hf``) or a flavor; an override replaces config.json's value."""

    architecture: str = ""  # config.json architectures[0] (as written back on export); "" = no folder given yet
    vocab_size: int = 0  # vocab_size
    dim: int = 0  # hidden_size
    n_layers: int = 0  # num_hidden_layers
    n_heads: int = 0  # num_attention_heads
    n_kv_heads: int = 0  # num_key_value_heads
    enable_weight_tying: bool = False  # tie_word_embeddings
    max_seq_len: int | None = None  # max_position_embeddings (the core checks training.seq_len against it)
    attn_implementation: AttnImpl = AttnImpl.auto
    # block_causal: packed rows keep each document to itself, through transformers' own
    # packed-sequence path (per-document position_ids); data.chat.pack sets it
    attn_mask: AttentionMask = AttentionMask.causal
    hf_config: dict[str, Any] = field(default_factory=dict)  # the rest of config.json, as is


# typed field <- config.json field
_TYPED = (("vocab_size", "vocab_size"), ("dim", "hidden_size"), ("n_layers", "num_hidden_layers"),
          ("n_heads", "num_attention_heads"), ("n_kv_heads", "num_key_value_heads"),
          ("enable_weight_tying", "tie_word_embeddings"), ("max_seq_len", "max_position_embeddings"))
_OURS = {theirs: ours for ours, theirs in _TYPED}
_OPTIONAL = ("tie_word_embeddings", "max_position_embeddings")  # absent: the architecture's default
# config.json fields that describe the file, not the model (rewritten on export)
_BOOKKEEPING = ("architectures", "transformers_version", "_name_or_path", "dtype", "torch_dtype")


def _bad(key: str, value: Any, why: str) -> ConfigError:
    return ConfigError(f"config.json: {key}={value!r}: {why}")


def _architecture_default(model_type: str, key: str) -> Any:
    """transformers' default for a field config.json leaves out (imports transformers:
    only for a folder, at launch, never for listing plugins)."""
    from transformers import AutoConfig

    return getattr(AutoConfig.for_model(model_type), key, None)


def config_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    """Values for :class:`HFModelConfig` from a config.json (the folder's, or a flavor's)."""
    archs = hf.get("architectures")
    arch = archs[0] if isinstance(archs, list) and archs else None
    if not isinstance(hf.get("model_type"), str) or not hf["model_type"]:
        raise _bad("model_type", hf.get("model_type"), "a transformers folder names its model_type")
    if not isinstance(arch, str):  # transformers picks the class by model_type alone: name that one
        from titan_hf.architecture import causal_lm_class

        arch = causal_lm_class(hf["model_type"]).__name__
    if hf.get("quantization_config"):
        raise _bad("quantization_config", hf["quantization_config"].get("quant_method"),
                   "quantized weights do not train; give a bf16/fp32 folder")
    if hf.get("output_router_logits"):  # transformers would add its router aux loss to the loss
        raise _bad("output_router_logits", True, "model=hf trains the language-model loss only; set it false")
    out: dict[str, Any] = {"architecture": arch}
    aliases = _aliases(hf["model_type"]) if any(theirs not in hf for _, theirs in _TYPED) else {}
    for ours, theirs in _TYPED:
        value = hf.get(theirs, hf.get(aliases.get(theirs, theirs)))  # GPT-2's n_embd is hidden_size
        if value is None and theirs == "num_key_value_heads":
            value = out.get("n_heads")  # transformers' default: multi-head attention (n_head, ... included)
        if value is None and theirs == "tie_word_embeddings":
            value = _architecture_default(hf["model_type"], theirs)
        if value is None and theirs in _OPTIONAL:
            continue
        if value is None:
            raise _bad(theirs, None, f"{arch} needs it")
        if ours != "enable_weight_tying" and (isinstance(value, bool) or not isinstance(value, int)):
            raise _bad(theirs, value, "must be an integer")
        out[ours] = value
    typed = {*dict(_TYPED).values(), *(aliases.get(theirs) for _, theirs in _TYPED if theirs not in hf)}
    # a typed field stated as null (max_position_embeddings: null) stays null: not the class's default
    out["hf_config"] = {k: copy.deepcopy(v) for k, v in hf.items() if k not in _BOOKKEEPING
                        and (k not in typed or (v is None and out.get(_OURS.get(k, "")) is None))}
    out["hf_config"]["_typed_as"] = {theirs: aliases[theirs] for _, theirs in _TYPED
                                     if theirs not in hf and aliases.get(theirs) in hf}
    if not out["hf_config"]["_typed_as"]:
        del out["hf_config"]["_typed_as"]
    return out


def _aliases(model_type: str) -> dict[str, str]:
    """transformers' attribute_map of the config class: the standard name -> the name
    the class's config.json uses (``hidden_size`` -> ``n_embd``). Imports transformers:
    only for a folder whose config.json lacks a standard name."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    try:
        return dict(getattr(CONFIG_MAPPING[model_type], "attribute_map", {}) or {})
    except KeyError:
        return {}


def hf_dict(config: HFModelConfig) -> dict[str, Any]:
    """The model's config.json fields (``hf_config`` with the typed fields on top): what
    the builder hands transformers and the export writes."""
    if not config.architecture:
        raise ConfigError("model.hf is not set: model=hf needs model.hf=DIR (a transformers model folder "
                          "with config.json and *.safetensors) or a test flavor (model.flavor=tiny_llama, ...)")
    out = dict(copy.deepcopy(config.hf_config))
    typed_as = out.pop("_typed_as", {})  # fields the folder names the class's own way (n_embd)
    for ours, theirs in _TYPED:
        if getattr(config, ours) is not None:
            out[typed_as.get(theirs, theirs)] = getattr(config, ours)
    n = config.n_layers
    for key in ("layer_types", "no_rope_layers"):  # per-layer lists follow model.n_layers
        if isinstance(out.get(key), list):
            out[key] = out[key][:n]
    return out


def config_to_hf(config: HFModelConfig) -> dict[str, Any]:
    """A config.json transformers 5.x loads as ``config.architecture``."""
    return {"architectures": [config.architecture], **hf_dict(config), "dtype": "float32"}


# ------------------------------------------------------------------ flavors
# Tiny random models of each tested family (vocab 256 fits the tests' synthetic data):
# every field the family's numerics depend on is set, so a flavor is also a recipe for a
# test folder (titan_hf.testing.save_folder).
_TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
             tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=None)

_TINY_JSON: dict[str, dict[str, Any]] = {
    "tiny_llama": {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **_TINY,
                   "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}},
    "tiny_qwen3": {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", **_TINY},
    "tiny_mistral": {"architectures": ["MistralForCausalLM"], "model_type": "mistral", **_TINY,
                     "sliding_window": None},
    "tiny_gemma3": {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", **_TINY,
                    "tie_word_embeddings": True, "sliding_window": 8, "query_pre_attn_scalar": 16,
                    "layer_types": ["sliding_attention", "full_attention"]},
    "tiny_phi3": {"architectures": ["Phi3ForCausalLM"], "model_type": "phi3", **_TINY},
    "tiny_olmo2": {"architectures": ["Olmo2ForCausalLM"], "model_type": "olmo2", **_TINY},
    "tiny_gpt_oss": {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss",
                     **{**_TINY, "intermediate_size": 32}, "num_local_experts": 4, "num_experts_per_tok": 2,
                     "sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"],
                     "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}},
    "tiny_mixtral": {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
                     **{**_TINY, "intermediate_size": 32}, "num_local_experts": 4, "num_experts_per_tok": 2,
                     "sliding_window": None},
    "tiny_qwen3_moe": {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", **_TINY,
                       "moe_intermediate_size": 32, "num_experts": 4, "num_experts_per_tok": 2,
                       "norm_topk_prob": True},
}

def _flavor(hf: dict[str, Any]) -> HFModelConfig:
    values = config_from_hf(hf)
    values["attn_implementation"] = AttnImpl(values.get("attn_implementation", AttnImpl.auto))
    return HFModelConfig(**values)


FLAVORS: dict[str, HFModelConfig] = {
    "folder": HFModelConfig(),  # everything from model.hf's config.json
    **{name: _flavor(hf) for name, hf in _TINY_JSON.items()},
}
