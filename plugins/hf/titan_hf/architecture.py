"""Which transformers class a folder is, and the attention kernel it runs with.

The class is found as ``AutoModelForCausalLM.from_pretrained`` finds it: config.json's
``model_type`` through transformers' causal-LM auto mapping (``architectures`` may
name another class; transformers itself ignores it there). No list of families gates
training: what the installed transformers builds as a decoder-only causal LM is
accepted, the rest is refused in one line with the reason. Imports transformers: called
at launch and when a model is built, never when plugins are listed.
"""

from __future__ import annotations

from typing import Any

from titan_plugins.errors import ConfigError

__all__ = ["attn_implementation", "causal_lm_class", "check_architecture"]


def _bad(key: str, value: Any, why: str) -> ConfigError:
    return ConfigError(f"config.json: {key}={value!r}: {why}")


def causal_lm_class(model_type: str) -> type:
    """transformers' causal-LM class for ``model_type`` (one line when there is none)."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    version = transformers.__version__
    if model_type not in CONFIG_MAPPING_NAMES:
        raise _bad("model_type", model_type, f"transformers {version} does not know it (a newer transformers may: "
                   "pip install -U transformers); remote code (auto_map) is not run by model=hf")
    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
    if name is None:
        raise _bad("model_type", model_type, f"transformers {version} has no causal LM for it (an encoder, an "
                   "encoder-decoder or a vision/audio model); model=hf trains decoder-only text models")
    cls = getattr(transformers, name, None)
    if cls is None:
        raise _bad("model_type", model_type, f"transformers {version} names {name} for it but cannot import it")
    return cls


def check_architecture(values: dict[str, Any]) -> type:
    """The class a config.json (``values``, its fields) builds, or one line saying why
    it cannot train here: not a decoder-only text causal LM of the installed transformers."""
    model_type = values.get("model_type")
    cls = causal_lm_class(model_type)
    name = cls.__name__
    if values.get("is_encoder_decoder") or not (name.endswith("ForCausalLM") or name.endswith("LMHeadModel")):
        raise _bad("model_type", model_type, f"its causal LM is {name}, a wrapper (encoder-decoder or "
                   "vision/audio) around a text decoder; give the text model's folder")
    return cls


def attn_implementation(cls: type, wanted: str) -> str:
    """``wanted`` (``auto``, ``sdpa``, ``eager``) resolved for ``cls``: ``auto`` is SDPA
    where the architecture has it (transformers' ``_supports_sdpa``), else eager."""
    sdpa = bool(getattr(cls, "_supports_sdpa", False))
    if wanted == "auto":
        return "sdpa" if sdpa else "eager"
    if wanted == "sdpa" and not sdpa:
        raise ConfigError(f"model.attn_implementation=sdpa: transformers runs {cls.__name__} without SDPA; "
                          "use model.attn_implementation=auto (or eager)")
    return wanted
