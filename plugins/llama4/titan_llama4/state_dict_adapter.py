"""State-dict names: this model <-> TorchTitan (identical) <-> Hugging Face Llama 4 text.

Declared once (``titan_plugins.hf.mapping``): both directions and the sharded
load's read plan follow from ``MAPPING``. Our names are TorchTitan's. Hugging Face
stores the routed experts as ``gate_up_proj (E, dim, 2*hidden)`` and ``down_proj
(E, hidden, dim)``, i.e. transposed and with w1/w3 concatenated; ``expert_bias`` has no HF counterpart: a model
loaded from a folder trains without it (``config_from_hf`` turns load balancing off),
``to_hf`` refuses a non-zero one (the export would route differently) and drops a zero
one; ``from_hf`` re-creates it as zeros when balancing is on.

Two layouts: ``Llama4ForCausalLM`` (``model.layers...``, ``lm_head.weight``), which
``to_hf`` writes (and ``config_to_hf`` describes), and ``Llama4ForConditionalGeneration``
(the same under ``language_model.``, next to a vision tower that is not loaded).
``from_hf`` reads both. Given ``hf_assets_path`` (the folder being loaded), ``to_hf``
uses that folder's layout, so a sharded load finds the names the folder holds.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from titan_plugins.hf.config import refuse_dropped
from titan_plugins.hf.mapping import Absent, Fuse, HFMapping, MappedAdapter, Rename, Transpose

__all__ = ["MAPPING", "Llama4StateDictAdapter"]

_L, _HF = "layers.{L}.", "model.layers.{L}."
_MULTIMODAL = "language_model."  # Llama4ForConditionalGeneration's text model


def _refuse_bias(key: str, value: Any) -> None:
    refuse_dropped(key, value, "Llama4ForCausalLM", "router bias (model.moe.load_balance_coeff "
                   "was set; train with model.moe.load_balance_coeff=null to export)")


def _zero_bias(c: Any) -> Any:
    """aux-loss-free balancing (TorchTitan's): zeros leave the routing as trained."""
    import torch

    if c is None or c.moe.load_balance_coeff is None:
        return None
    return torch.zeros(c.moe.num_experts, dtype=torch.float32)


MAPPING = HFMapping(
    Rename("tok_embeddings.weight", "model.embed_tokens.weight"),
    Rename("norm.weight", "model.norm.weight"),
    Rename("output.weight", "lm_head.weight"),
    *(Rename(f"{_L}attention.{ours}.weight", f"{_HF}self_attn.{hf}.weight")
      for ours, hf in (("wq", "q_proj"), ("wk", "k_proj"), ("wv", "v_proj"), ("wo", "o_proj"))),
    Rename(_L + "attention_norm.weight", _HF + "input_layernorm.weight"),
    Rename(_L + "ffn_norm.weight", _HF + "post_attention_layernorm.weight"),
    *(Rename(f"{_L}{ours}.{w}.weight", f"{_HF}{hf}{proj}.weight")
      for ours, hf in (("feed_forward", "feed_forward."), ("moe.shared_experts", "feed_forward.shared_expert."))
      for w, proj in (("w1", "gate_proj"), ("w2", "down_proj"), ("w3", "up_proj"))),
    Rename(_L + "moe.router.gate.weight", _HF + "feed_forward.router.weight"),
    # ours (E, hidden, dim) each -> HF (E, dim, 2*hidden), gate (w1) first
    Fuse(_HF + "feed_forward.experts.gate_up_proj", [_L + "moe.experts.w1", _L + "moe.experts.w3"],
         dim=-1, transform=Transpose()),
    Rename(_L + "moe.experts.w2", _HF + "feed_forward.experts.down_proj", Transpose()),
    Absent(_L + "moe.expert_bias", check=_refuse_bias, default=_zero_bias, alongside=_L + "moe.router.gate.weight"),
    skip=["freqs_cis", r".*\.tokens_per_expert"],
    ignore_hf=[r"vision_model\..*", r"multi_modal_projector\..*"],  # the multimodal model's vision tower
    read_prefixes=[_MULTIMODAL],
)


def _folder_prefix(folder: str | None) -> str:
    """``language_model.`` for a multimodal folder (config.json's model_type llama4)."""
    config = Path(folder) / "config.json" if folder else None
    if config is None or not config.is_file():
        return ""
    return _MULTIMODAL if json.loads(config.read_text()).get("model_type") == "llama4" else ""


class Llama4StateDictAdapter(MappedAdapter):
    """Constructed with the model config; works on plain tensors (full state dicts)."""

    def __init__(self, config: Any = None, hf_assets_path: str | None = None):
        super().__init__(config, hf_assets_path)
        self.mapping = MAPPING.with_prefix(_folder_prefix(hf_assets_path))
