"""Our parameter names <-> the folder's (transformers' own checkpoint names).

The wrapper (``titan_hf.model``) hoists transformers' modules to the core's names:
``model.embed_tokens`` -> ``tok_embeddings``, ``model.layers.N`` -> ``layers.N``,
``model.norm`` -> ``norm``, ``lm_head`` -> ``output``. Everything under them keeps
transformers' names, so the mapping is pure renames and the core's loader reads each
rank's slices only. A tied output weight is the embedding: not written, not read.
Only architectures whose in-memory layout is their checkpoint layout are supported
(transformers 5 fuses some MoE experts in memory; see ``titan_hf.config.SUPPORTED``).
"""

from __future__ import annotations

from typing import Any

__all__ = ["HFStateDictAdapter", "to_hf_name", "from_hf_name"]

_OURS_TO_HF = (("tok_embeddings.", "model.embed_tokens."), ("layers.", "model.layers."),
               ("norm.", "model.norm."), ("output.", "lm_head."))


def to_hf_name(key: str) -> str:
    for ours, theirs in _OURS_TO_HF:
        if key.startswith(ours):
            return theirs + key[len(ours):]
    raise KeyError(f"{key!r} has no Hugging Face name")


def from_hf_name(key: str) -> str:
    for ours, theirs in _OURS_TO_HF:
        if key.startswith(theirs):
            return ours + key[len(theirs):]
    raise KeyError(f"{key!r} is not a causal LM checkpoint name")


class HFStateDictAdapter:
    """``to_hf`` / ``from_hf`` for ``model=hf`` (renames; the tensors are handed on)."""

    def __init__(self, config: Any) -> None:
        self.tied = bool(config.enable_weight_tying)

    def to_hf(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        return {to_hf_name(k): v for k, v in state_dict.items() if not (self.tied and k == "output.weight")}

    def from_hf(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        out = {from_hf_name(k): v for k, v in state_dict.items()}
        if self.tied and "tok_embeddings.weight" in out:
            out["output.weight"] = out["tok_embeddings.weight"]
        return out

    # TorchTitan names are ours (no separate TorchTitan layout exists for these models)
    def to_torchtitan(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        return dict(state_dict)

    def from_torchtitan(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        return dict(state_dict)
