"""State-dict names: this model <-> TorchTitan (identical) <-> Hugging Face Llama 4 text.

Our names are TorchTitan's, so ``to_torchtitan``/``from_torchtitan`` only drop what
is not a checkpoint entry. Hugging Face stores the routed experts as
``gate_up_proj (E, dim, 2*hidden)`` and ``down_proj (E, hidden, dim)``, i.e.
transposed and with w1/w3 concatenated; ``expert_bias`` has no HF counterpart
(``to_hf`` drops it, as TorchTitan's adapter does; ``from_hf`` re-creates it as zeros).

Two layouts: ``Llama4ForCausalLM`` (``model.layers...``, ``lm_head.weight``), which
``to_hf`` writes (and ``config_to_hf`` describes), and ``Llama4ForConditionalGeneration``
(the same under ``language_model.``, next to a vision tower that is not loaded).
``from_hf`` reads both. Given ``hf_assets_path`` (the folder being loaded), ``to_hf``
uses that folder's layout, so a sharded load finds the names the folder holds.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

__all__ = ["Llama4StateDictAdapter"]

_HF = "model.layers.{}."
# our name (with {} for the layer) -> HF name (Llama4ForCausalLM)
_TO_HF = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "layers.{}.attention.wq.weight": _HF + "self_attn.q_proj.weight",
    "layers.{}.attention.wk.weight": _HF + "self_attn.k_proj.weight",
    "layers.{}.attention.wv.weight": _HF + "self_attn.v_proj.weight",
    "layers.{}.attention.wo.weight": _HF + "self_attn.o_proj.weight",
    "layers.{}.attention_norm.weight": _HF + "input_layernorm.weight",
    "layers.{}.ffn_norm.weight": _HF + "post_attention_layernorm.weight",
    "layers.{}.feed_forward.w1.weight": _HF + "feed_forward.gate_proj.weight",
    "layers.{}.feed_forward.w2.weight": _HF + "feed_forward.down_proj.weight",
    "layers.{}.feed_forward.w3.weight": _HF + "feed_forward.up_proj.weight",
    "layers.{}.moe.router.gate.weight": _HF + "feed_forward.router.weight",
    "layers.{}.moe.shared_experts.w1.weight": _HF + "feed_forward.shared_expert.gate_proj.weight",
    "layers.{}.moe.shared_experts.w2.weight": _HF + "feed_forward.shared_expert.down_proj.weight",
    "layers.{}.moe.shared_experts.w3.weight": _HF + "feed_forward.shared_expert.up_proj.weight",
}
_FROM_HF = {v: k for k, v in _TO_HF.items()}
_GATE_UP = _HF + "feed_forward.experts.gate_up_proj"
_DOWN = _HF + "feed_forward.experts.down_proj"
_NO_HF = ("layers.{}.moe.expert_bias",)
_LAYER = re.compile(r"(?<=layers\.)(\d+)(?=\.)")
_MULTIMODAL = "language_model."  # Llama4ForConditionalGeneration's text model
_VISION = ("vision_model.", "multi_modal_projector.")


def _template(key: str) -> tuple[str, str | None]:
    match = _LAYER.search(key)
    if match is None:
        return key, None
    return key[: match.start()] + "{}" + key[match.end() :], match.group(1)


def _folder_prefix(folder: str | None) -> str:
    """``language_model.`` for a multimodal folder (config.json's model_type llama4)."""
    config = Path(folder) / "config.json" if folder else None
    if config is None or not config.is_file():
        return ""
    return _MULTIMODAL if json.loads(config.read_text()).get("model_type") == "llama4" else ""


class Llama4StateDictAdapter:
    """Constructed with the model config; works on plain tensors (full state dicts)."""

    def __init__(self, config: Any = None, hf_assets_path: str | None = None):
        self.config = config
        self.hf_assets_path = hf_assets_path
        self.prefix = _folder_prefix(hf_assets_path)

    # ---------------------------------------------------------- TorchTitan
    def to_torchtitan(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """TorchTitan's ``Transformer`` uses the same names; non-persistent buffers
        (``freqs_cis``, ``tokens_per_expert``) are never in either."""
        return {k: v for k, v in state_dict.items() if not _is_buffer_only(k)}

    def from_torchtitan(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in state_dict.items() if not _is_buffer_only(k)}

    # -------------------------------------------------------- Hugging Face
    def to_hf(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        experts: dict[str, dict[str, Any]] = {}
        for key, value in state_dict.items():
            template, layer = _template(key)
            if template in _TO_HF:
                out[_TO_HF[template].format(layer)] = value
            elif template in ("layers.{}.moe.experts.w1", "layers.{}.moe.experts.w3"):
                experts.setdefault(layer, {})[template[-2:]] = value
            elif template == "layers.{}.moe.experts.w2":
                out[_DOWN.format(layer)] = value.transpose(-1, -2)
            elif template in _NO_HF or _is_buffer_only(key):
                continue
            else:
                raise KeyError(f"no Hugging Face name for {key!r}")
        for layer, parts in experts.items():
            # ours (E, hidden, dim) each -> HF (E, dim, 2*hidden), gate (w1) first
            out[_GATE_UP.format(layer)] = _cat_last(
                parts["w1"].transpose(-1, -2), parts["w3"].transpose(-1, -2)
            )
        return {self.prefix + k: v for k, v in out.items()}

    def from_hf(self, hf_state_dict: dict[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in hf_state_dict.items():
            if key.startswith(_VISION):  # the multimodal model's vision tower: not ours
                continue
            template, layer = _template(key.removeprefix(_MULTIMODAL))
            if template in _FROM_HF:
                out[_FROM_HF[template].format(layer)] = value
            elif template == _GATE_UP:
                w1, w3 = value.chunk(2, dim=-1)
                out[f"layers.{layer}.moe.experts.w1"] = w1.transpose(-1, -2)
                out[f"layers.{layer}.moe.experts.w3"] = w3.transpose(-1, -2)
            elif template == _DOWN:
                out[f"layers.{layer}.moe.experts.w2"] = value.transpose(-1, -2)
            else:
                raise KeyError(f"unknown Hugging Face Llama 4 text key {key!r}")
        return self._add_missing(out)

    def _add_missing(self, out: dict[str, Any]) -> dict[str, Any]:
        """Entries Hugging Face checkpoints do not hold: ``expert_bias`` (aux-loss-free
        balancing, TorchTitan's; zeros leave the routing as trained) for every MoE layer."""
        c = self.config
        if c is None or c.moe.load_balance_coeff is None:
            return out
        import torch

        for layer in sorted({k.split(".")[1] for k in out if ".moe." in k}, key=int):
            out.setdefault(f"layers.{layer}.moe.expert_bias", torch.zeros(c.moe.num_experts, dtype=torch.float32))
        return out


def _is_buffer_only(key: str) -> bool:
    return key == "freqs_cis" or key.endswith(".tokens_per_expert")


def _cat_last(a: Any, b: Any) -> Any:
    import torch

    return torch.cat([a, b], dim=-1)
