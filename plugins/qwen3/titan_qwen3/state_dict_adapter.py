"""State-dict names: TorchTitan (identical to ours) and Hugging Face Qwen3 / Qwen3-MoE.

Our parameter names are TorchTitan v0.2.2's, so ``to_torchtitan`` / ``from_torchtitan``
only drop what is not a checkpoint entry. Hugging Face keeps one tensor per expert
(``mlp.experts.{e}.gate_proj``); TorchTitan stacks them (``moe.experts.w1`` is
``[E, hidden, dim]``, the same row layout as ``gate_proj.weight`` per expert).
"""

from __future__ import annotations

import re
from typing import Any

import torch

from titan_qwen3.config import Qwen3Config

# ours (layer index as {}) -> Hugging Face
_TO_HF: dict[str, str] = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "layers.{}.attention.wq.weight": "model.layers.{}.self_attn.q_proj.weight",
    "layers.{}.attention.wk.weight": "model.layers.{}.self_attn.k_proj.weight",
    "layers.{}.attention.wv.weight": "model.layers.{}.self_attn.v_proj.weight",
    "layers.{}.attention.wo.weight": "model.layers.{}.self_attn.o_proj.weight",
    "layers.{}.attention.q_norm.weight": "model.layers.{}.self_attn.q_norm.weight",
    "layers.{}.attention.k_norm.weight": "model.layers.{}.self_attn.k_norm.weight",
    "layers.{}.attention_norm.weight": "model.layers.{}.input_layernorm.weight",
    "layers.{}.ffn_norm.weight": "model.layers.{}.post_attention_layernorm.weight",
    "layers.{}.feed_forward.w1.weight": "model.layers.{}.mlp.gate_proj.weight",
    "layers.{}.feed_forward.w3.weight": "model.layers.{}.mlp.up_proj.weight",
    "layers.{}.feed_forward.w2.weight": "model.layers.{}.mlp.down_proj.weight",
    "layers.{}.moe.router.gate.weight": "model.layers.{}.mlp.gate.weight",
}
_FROM_HF = {v: k for k, v in _TO_HF.items()}
# stacked expert weight -> per-expert Hugging Face name (layer, expert)
_EXPERTS_TO_HF = {
    "w1": "model.layers.{}.mlp.experts.{}.gate_proj.weight",
    "w3": "model.layers.{}.mlp.experts.{}.up_proj.weight",
    "w2": "model.layers.{}.mlp.experts.{}.down_proj.weight",
}
_HF_EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")
_HF_PROJ_TO_W = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
_OUR_EXPERTS = re.compile(r"layers\.(\d+)\.moe\.experts\.(w1|w2|w3)")
# Entries of our state_dict() that have no Hugging Face counterpart.
_NOT_IN_HF = re.compile(r"layers\.\d+\.moe\.(expert_bias|tokens_per_expert)")
_HF_IGNORED = re.compile(r".*rotary_emb\.inv_freq")


def _abstract(key: str) -> tuple[str, str | None]:
    match = re.search(r"\d+", key)
    if match is None:
        return key, None
    return key[: match.start()] + "{}" + key[match.end():], match.group(0)


def _full(t: Any) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


class Qwen3StateDictAdapter:
    """Converts model state dicts; constructed with the model's ``Qwen3Config``."""

    def __init__(self, config: Qwen3Config, hf_assets_path: str | None = None):
        self.config = config
        self.hf_assets_path = hf_assets_path

    # ------------------------------------------------------------ TorchTitan
    def to_torchtitan(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """Our names are TorchTitan's; non-persistent buffers are dropped if present."""
        return {k: v for k, v in state_dict.items() if not k.endswith(("rope_cache", "tokens_per_expert"))}

    def from_torchtitan(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        return self.to_torchtitan(state_dict)

    # --------------------------------------------------------- Hugging Face
    def to_hf(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """Hugging Face names; stacked experts split per expert; a tied output
        weight is left out (HF ties ``lm_head`` to ``embed_tokens``)."""
        out: dict[str, Any] = {}
        for key, value in state_dict.items():
            experts = _OUR_EXPERTS.fullmatch(key)
            if experts:
                layer, w = experts.groups()
                full = _full(value)
                for e in range(full.shape[0]):
                    out[_EXPERTS_TO_HF[w].format(layer, e)] = full[e]
                continue
            if _NOT_IN_HF.fullmatch(key) or key.endswith("rope_cache"):
                continue
            if key == "output.weight" and self.config.enable_weight_tying:
                continue
            abstract, layer = _abstract(key)
            if abstract not in _TO_HF:
                raise KeyError(f"no Hugging Face name for {key!r}")
            out[_TO_HF[abstract].format(layer)] = value
        return out

    def from_hf(self, hf_state_dict: dict[str, Any]) -> dict[str, Any]:
        """Our names from Hugging Face ones; per-expert weights stacked;
        ``expert_bias`` (not in HF checkpoints) starts at zero."""
        out: dict[str, Any] = {}
        experts: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
        for key, value in hf_state_dict.items():
            if _HF_IGNORED.fullmatch(key):
                continue
            match = _HF_EXPERT.fullmatch(key)
            if match:
                layer, e, proj = match.groups()
                experts.setdefault((layer, _HF_PROJ_TO_W[proj]), {})[int(e)] = value
                continue
            abstract, layer = _abstract(key)
            if abstract not in _FROM_HF:
                raise KeyError(f"unknown Hugging Face Qwen3 entry {key!r}")
            out[_FROM_HF[abstract].format(layer)] = value
        for (layer, w), per_expert in experts.items():
            n = len(per_expert)
            if sorted(per_expert) != list(range(n)):
                raise KeyError(f"layer {layer} {w}: experts {sorted(per_expert)} are not 0..{n - 1}")
            out[f"layers.{layer}.moe.experts.{w}"] = torch.stack([per_expert[e] for e in range(n)])
        c = self.config
        if c.enable_weight_tying and "output.weight" not in out and "tok_embeddings.weight" in out:
            out["output.weight"] = out["tok_embeddings.weight"]
        if c.moe_enabled and c.moe.load_balance_coeff is not None:
            for layer in {k.split(".")[1] for k in out if ".moe." in k}:
                out.setdefault(
                    f"layers.{layer}.moe.expert_bias", torch.zeros(c.moe.num_experts, dtype=torch.float32)
                )
        return out
