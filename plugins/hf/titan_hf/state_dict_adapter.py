"""Our parameter names <-> the folder's (transformers' own checkpoint names).

The wrapper (``titan_hf.model``) hoists transformers' modules to the core's names:
``model.embed_tokens`` -> ``tok_embeddings``, ``model.layers.N`` -> ``layers.N``,
``model.norm`` -> ``norm``, ``lm_head`` -> ``output``. Everything under them keeps
transformers' names, so most entries are pure renames and the core's loader reads each
rank's slices only. A tied output weight is the embedding: not written, not read.

transformers 5 fuses some MoE experts in memory but not in their checkpoints (its
``conversion_mapping``): Mixtral's and Qwen3-MoE's ``mlp.experts.gate_up_proj``
``[E, 2I, H]`` is, per expert, the gate and up projections concatenated on dim 1
(``w1``/``w3``, ``gate_proj``/``up_proj``) and ``mlp.experts.down_proj`` ``[E, H, I]``
the stacked ``w2``/``down_proj``; Mixtral's ``mlp`` is ``block_sparse_moe`` on disk.
"""

from __future__ import annotations

import re
from typing import Any

import torch

__all__ = ["HFStateDictAdapter", "from_hf_name", "to_hf_name"]

_OURS_TO_HF = (("tok_embeddings.", "model.embed_tokens."), ("layers.", "model.layers."),
               ("norm.", "model.norm."), ("output.", "lm_head."))
# model_type -> (the MoE block's name on disk, (gate, up, down) expert names on disk)
_SPLIT_EXPERTS = {"mixtral": ("block_sparse_moe", ("w1", "w3", "w2")),
                  "qwen3_moe": ("mlp", ("gate_proj", "up_proj", "down_proj"))}
_FUSED = re.compile(r"^(layers\.\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$")
_DISK_EXPERT = re.compile(r"^model\.(layers\.\d+)\.\w+\.experts\.(\d+)\.(\w+)\.weight$")


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
    """``to_hf`` / ``from_hf`` for ``model=hf`` (tensors handed on; experts as views)."""

    def __init__(self, config: Any) -> None:
        self.tied = bool(config.enable_weight_tying)
        self.split = _SPLIT_EXPERTS.get(config.hf_config.get("model_type"))

    def _disk(self, name: str) -> str:
        hf = to_hf_name(name)
        if self.split and self.split[0] != "mlp":
            hf = hf.replace(".mlp.", f".{self.split[0]}.", 1)
        return hf

    def to_hf(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in state_dict.items():
            if self.tied and key == "output.weight":
                continue
            match = _FUSED.match(key) if self.split else None
            if match is None:
                out[self._disk(key)] = value
                continue
            block, (gate, up, down) = f"model.{match[1]}.{self.split[0]}.experts", self.split[1]
            if match[2] == "down_proj":
                out.update({f"{block}.{e}.{down}.weight": value[e] for e in range(value.shape[0])})
            else:
                inter = value.shape[1] // 2
                for e in range(value.shape[0]):
                    out[f"{block}.{e}.{gate}.weight"] = value[e, :inter]
                    out[f"{block}.{e}.{up}.weight"] = value[e, inter:]
        return out

    def from_hf(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        experts: dict[tuple[str, str], dict[int, Any]] = {}
        for key, value in state_dict.items():
            match = _DISK_EXPERT.match(key) if self.split else None
            if match is None:
                ours = from_hf_name(key)
                if self.split and self.split[0] != "mlp":
                    ours = ours.replace(f".{self.split[0]}.", ".mlp.", 1)
                out[ours] = value
            else:
                experts.setdefault((match[1], match[3]), {})[int(match[2])] = value
        if self.split:
            gate, up, down = self.split[1]
            for layer in sorted({layer for layer, _ in experts}):
                def stacked(name: str, layer: str = layer) -> torch.Tensor | None:
                    parts = experts.get((layer, name))
                    return torch.stack([parts[e] for e in sorted(parts)]) if parts else None
                g, u, d = stacked(gate), stacked(up), stacked(down)
                if g is not None and u is not None:
                    out[f"{layer}.mlp.experts.gate_up_proj"] = torch.cat([g, u], dim=1)
                if d is not None:
                    out[f"{layer}.mlp.experts.down_proj"] = d
        if self.tied and "tok_embeddings.weight" in out:
            out["output.weight"] = out["tok_embeddings.weight"]
        return out

    # TorchTitan names are ours (no separate TorchTitan layout exists for these models)
    def to_torchtitan(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        return dict(state_dict)

    def from_torchtitan(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        return dict(state_dict)
