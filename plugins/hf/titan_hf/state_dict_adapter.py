"""Our parameter names <-> the folder's (transformers' own checkpoint names).

The wrapper (``titan_hf.model``) hoists transformers' modules to the core's names
(``tok_embeddings``, ``layers.N``, ``norm``, ``output``); where they live in the
transformers model is read from the model's declarations (``titan_hf.structure``), so
most entries are pure renames and the core's loader reads each rank's slices only. A
tied output weight is the embedding: not written, not read.

Checkpoints need not hold the in-memory layout: transformers 5 fuses MoE experts in
memory (``gate_up_proj [E, 2I, H]``) while most folders store one tensor per expert,
and some families rename modules on disk. The conversion is transformers' own, the
one ``from_pretrained`` and ``save_pretrained`` apply (its checkpoint conversion
mapping for the model's class), never a table of families kept here.
"""

from __future__ import annotations

import copy
import functools
import json
from typing import Any

import torch
from torch import nn

__all__ = ["HFStateDictAdapter", "from_hf_name", "meta_shell", "to_hf_name"]


@functools.lru_cache(maxsize=8)
def _shell(config_json: str) -> nn.Module:
    from transformers import AutoModelForCausalLM

    from titan_hf.config import HFModelConfig
    from titan_hf.model import hf_config_object

    hf = hf_config_object(HFModelConfig(**json.loads(config_json)))
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(hf, attn_implementation=hf._attn_implementation)


def meta_shell(config: Any) -> nn.Module:
    """transformers' model for ``config`` (an ``HFModelConfig``) on the meta device;
    cached, never modified."""
    import dataclasses

    fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    fields["attn_implementation"] = getattr(fields["attn_implementation"], "value", fields["attn_implementation"])
    return _shell(json.dumps(fields, sort_keys=True, default=str))


def _renames(config: Any) -> tuple[tuple[str, str], ...]:
    from titan_hf.structure import find_structure

    return find_structure(meta_shell(config)).renames()


_DEFAULT = (("tok_embeddings.", "model.embed_tokens."), ("layers.", "model.layers."),
            ("norm.", "model.norm."), ("output.", "lm_head."))


def to_hf_name(key: str, renames: tuple[tuple[str, str], ...] = _DEFAULT) -> str:
    """Our name -> transformers' module name (``renames`` from the model's structure;
    the default is the Llama-like layout most architectures share)."""
    for ours, theirs in renames:
        if key.startswith(ours):
            return theirs + key[len(ours):]
    raise KeyError(f"{key!r} has no Hugging Face name")


def from_hf_name(key: str, renames: tuple[tuple[str, str], ...] = _DEFAULT) -> str:
    for ours, theirs in renames:
        if key.startswith(theirs):
            return ours + key[len(theirs):]
    raise KeyError(f"{key!r} is not a causal LM checkpoint name")


def to_model_layout(shell: nn.Module, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Checkpoint tensors -> the model's in-memory names and layout, through the
    conversions ``from_pretrained`` applies (renames, experts merged, ...)."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import (
        WeightConverter,
        WeightRenaming,
        dot_natural_key,
        rename_source_key,
    )

    transforms = get_model_conversion_mapping(shell)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    meta = shell.state_dict()
    out: dict[str, torch.Tensor] = {}
    pending: dict[str, Any] = {}
    for key, tensor in sorted(tensors.items(), key=lambda kv: dot_natural_key(kv[0])):
        renamed, pattern = rename_source_key(key, renamings, converters, shell.base_model_prefix, meta)
        if renamed not in meta and key in meta:
            renamed, pattern = key, None
        if pattern is None:
            out[renamed] = tensor
            continue
        converter = pending.setdefault(renamed, copy.deepcopy(by_pattern[pattern]))
        converter.add_tensor(renamed, key, pattern, lambda t=tensor: t)  # a callable: transformers' sync path
    for name, converter in pending.items():
        for target, value in converter.convert(name, model=shell, config=shell.config).items():
            out[target] = value[0] if isinstance(value, list) else value
    return out


class HFStateDictAdapter:
    """``to_hf`` / ``from_hf`` for ``model=hf``."""

    def __init__(self, config: Any) -> None:
        self.config = config
        self.tied = bool(config.enable_weight_tying)

    @functools.cached_property
    def renames(self) -> tuple[tuple[str, str], ...]:
        return _renames(self.config)

    @functools.cached_property
    def shell(self) -> nn.Module:
        return meta_shell(self.config)

    def to_hf(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """Our names -> the folder's names and layout (``save_pretrained``'s conversion)."""
        from transformers.core_model_loading import revert_weight_conversion

        return revert_weight_conversion(self.shell, self.to_hf_modules(state_dict))

    def to_hf_modules(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """Our names -> the names of the model ``from_pretrained`` builds (no checkpoint
        conversion): what peft targets, since it adapts the loaded model's modules
        (a folder may store ``attention.query_key_value`` that loads as ``self_attn.qkv_proj``)."""
        return {to_hf_name(k, self.renames): v for k, v in state_dict.items()
                if not (self.tied and k == "output.weight")}

    def from_hf(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        out = {from_hf_name(k, self.renames): v for k, v in to_model_layout(self.shell, state_dict).items()}
        if self.tied and "tok_embeddings.weight" in out:
            out["output.weight"] = out["tok_embeddings.weight"]
        return out

    # TorchTitan names are ours (no separate TorchTitan layout exists for these models)
    def to_torchtitan(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        return dict(state_dict)

    def from_torchtitan(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        return dict(state_dict)
