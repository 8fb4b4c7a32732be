"""State-dict names: TorchTitan (identical to ours) and Hugging Face Qwen3 / Qwen3-MoE,
declared once (``titan_plugins.hf.mapping``); both directions and the sharded load's
read plan follow from ``MAPPING``.

Hugging Face keeps one tensor per expert (``mlp.experts.{e}.gate_proj``); TorchTitan
stacks them (``moe.experts.w1`` is ``[E, hidden, dim]``, the same row layout as
``gate_proj.weight`` per expert). Qwen3-MoE's router has no bias: a trained non-zero
``expert_bias`` is refused on export, a zero one re-created on load when balancing is on.
"""

from __future__ import annotations

from typing import Any

import torch

from titan_plugins.hf.config import refuse_dropped
from titan_plugins.hf.mapping import Absent, HFMapping, MappedAdapter, Rename, Stack, Tied

__all__ = ["MAPPING", "Qwen3StateDictAdapter"]

_L, _HF = "layers.{L}.", "model.layers.{L}."


def _refuse_bias(key: str, value: Any) -> None:
    refuse_dropped(key, value, "Qwen3MoeForCausalLM", "router bias (model.moe.load_balance_coeff "
                   "was set; train with model.moe.load_balance_coeff=null to export)")


def _zero_bias(c: Any) -> torch.Tensor | None:
    balancing = c.moe_enabled and c.moe.load_balance_coeff is not None
    return torch.zeros(c.moe.num_experts, dtype=torch.float32) if balancing else None


MAPPING = HFMapping(
    Rename("tok_embeddings.weight", "model.embed_tokens.weight"),
    Rename("norm.weight", "model.norm.weight"),
    Tied("output.weight", "tok_embeddings.weight", when=lambda c: c.enable_weight_tying),
    Rename("output.weight", "lm_head.weight"),
    *(Rename(f"{_L}attention.{ours}.weight", f"{_HF}self_attn.{hf}.weight") for ours, hf in (
        ("wq", "q_proj"), ("wk", "k_proj"), ("wv", "v_proj"), ("wo", "o_proj"), ("q_norm", "q_norm"),
        ("k_norm", "k_norm"))),
    Rename(_L + "attention_norm.weight", _HF + "input_layernorm.weight"),
    Rename(_L + "ffn_norm.weight", _HF + "post_attention_layernorm.weight"),
    *(Rename(f"{_L}feed_forward.{w}.weight", f"{_HF}mlp.{hf}.weight") for w, hf in (
        ("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj"))),
    Rename(_L + "moe.router.gate.weight", _HF + "mlp.gate.weight"),
    *(Stack(f"{_L}moe.experts.{w}", f"{_HF}mlp.experts.{{E}}.{hf}.weight") for w, hf in (
        ("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj"))),
    Absent(_L + "moe.expert_bias", check=_refuse_bias, default=_zero_bias, alongside=_L + "moe.router.gate.weight"),
    skip=[r"layers\.\d+\.moe\.tokens_per_expert", r".*rope_cache"],
    ignore_hf=[r".*rotary_emb\.inv_freq"],
)


class Qwen3StateDictAdapter(MappedAdapter):
    """Converts model state dicts; constructed with the model's ``Qwen3Config``."""

    mapping = MAPPING
