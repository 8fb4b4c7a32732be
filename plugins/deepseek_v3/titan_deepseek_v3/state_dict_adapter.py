"""State-dict names: this plugin <-> TorchTitan <-> Hugging Face DeepSeek-V3.

This model uses TorchTitan's parameter names except for the output projection,
``lm_head.weight`` here and ``output.weight`` in TorchTitan. Hugging Face checkpoints
keep one 2-D weight per routed expert (``mlp.experts.{e}.gate_proj``); here and in
TorchTitan they are stacked into ``(num_experts, ...)`` tensors. No tensor is permuted:
all three use DeepSeek's interleaved (complex-pair) rotary layout.

The Hugging Face names are declared once (``MAPPING``, ``titan_plugins.hf.mapping``);
hand-written here is only what a declaration cannot say: fp8 checkpoints, the
multi-token-prediction layers past ``n_layers``, and the routing bias with balancing off.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from titan_deepseek_v3.config import DeepSeekV3Config
from titan_plugins.errors import ConfigError
from titan_plugins.hf.mapping import HFMapping, MappedAdapter, Rename, Stack

__all__ = ["MAPPING", "DeepSeekV3StateDictAdapter"]

_L, _HF = "layers.{L}.", "model.layers.{L}."
_LAYER = {  # ours -> Hugging Face, inside a layer
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wq_a.weight": "self_attn.q_a_proj.weight",
    "attention.q_norm.weight": "self_attn.q_a_layernorm.weight",
    "attention.wq_b.weight": "self_attn.q_b_proj.weight",
    "attention.wkv_a.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attention.kv_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attention.wkv_b.weight": "self_attn.kv_b_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "moe.router.gate.weight": "mlp.gate.weight",
    "moe.expert_bias": "mlp.gate.e_score_correction_bias",
}
_PROJ = (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj"))

MAPPING = HFMapping(
    Rename("tok_embeddings.weight", "model.embed_tokens.weight"),
    Rename("norm.weight", "model.norm.weight"),
    Rename("lm_head.weight", "lm_head.weight"),
    *(Rename(_L + ours, _HF + hf) for ours, hf in _LAYER.items()),
    *(Rename(f"{_L}feed_forward.{w}.weight", f"{_HF}mlp.{hf}.weight") for w, hf in _PROJ),
    *(Rename(f"{_L}moe.shared_experts.{w}.weight", f"{_HF}mlp.shared_experts.{hf}.weight") for w, hf in _PROJ),
    *(Stack(f"{_L}moe.experts.{w}", f"{_HF}mlp.experts.{{E}}.{hf}.weight",
            count=lambda c: c.layer.moe.num_experts) for w, hf in _PROJ),
    ignore_hf=[r".*rotary_emb\.inv_freq"],
)
_OURS_TO_TT = {"lm_head.weight": "output.weight"}
_HF_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")
_GATE_RE = re.compile(r"^layers\.(\d+)\.moe\.router\.gate\.weight$")
_BIAS = "mlp.gate.e_score_correction_bias"


class DeepSeekV3StateDictAdapter(MappedAdapter):
    """``to_torchtitan`` / ``from_torchtitan`` / ``to_hf`` / ``from_hf``; each returns a
    new dict sharing the tensors where no reshaping is needed."""

    mapping = MAPPING
    config: DeepSeekV3Config

    def to_torchtitan(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        return {_OURS_TO_TT.get(k, k): v for k, v in state_dict.items()}

    def from_torchtitan(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        back = {tt: ours for ours, tt in _OURS_TO_TT.items()}
        return {back.get(k, k): v for k, v in state_dict.items()}

    def to_hf(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """With balancing off (no ``expert_bias``) Hugging Face's routing bias is written as zeros."""
        out = super().to_hf(state_dict)
        if self.config.layer.moe.load_balance_coeff is None:
            for key, value in state_dict.items():
                if (m := _GATE_RE.match(key)) is not None:
                    out[f"model.layers.{m.group(1)}.{_BIAS}"] = torch.zeros(
                        value.shape[0], dtype=torch.float32, device=value.device)
        return out

    def from_hf(self, hf_state_dict: dict[str, Any]) -> dict[str, Any]:
        """Layers at or past ``n_layers`` (DeepSeek-V3's multi-token-prediction layer 61)
        are skipped; fp8 weights with ``weight_scale_inv`` must be dequantized first.
        With balancing off (``load_balance_coeff=None``, no ``expert_bias``) a zero
        ``e_score_correction_bias`` is dropped, any other is an error."""
        kept: dict[str, Any] = {}
        for key, value in hf_state_dict.items():
            if key.endswith("weight_scale_inv"):
                raise ValueError(f"from_hf: {key!r} belongs to an fp8-quantized checkpoint; dequantize it first")
            layer = _HF_LAYER_RE.match(key)
            if layer is not None and int(layer.group(1)) >= self.config.n_layers:
                continue
            if key.endswith(_BIAS) and self.config.layer.moe.load_balance_coeff is None:
                if bool(value.any()):  # it steers the routing: never drop it silently
                    raise ConfigError(
                        f"model.layer.moe.load_balance_coeff=None: the model has no expert_bias for {key!r}; "
                        "set a load_balance_coeff to keep the checkpoint's routing bias"
                    )
                continue
            kept[key] = value
        return super().from_hf(kept)
