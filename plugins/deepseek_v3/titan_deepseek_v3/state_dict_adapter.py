"""State-dict names: this plugin <-> TorchTitan <-> Hugging Face DeepSeek-V3.

This model uses TorchTitan's parameter names except for the output projection,
``lm_head.weight`` here and ``output.weight`` in TorchTitan. Hugging Face checkpoints
keep one 2-D weight per routed expert (``mlp.experts.{e}.gate_proj``); here and in
TorchTitan they are stacked into ``(num_experts, ...)`` tensors. No tensor is permuted:
all three use DeepSeek's interleaved (complex-pair) rotary layout.

The adapter works on full (unsharded) state dicts, e.g. for offline conversion or
``torch.distributed.checkpoint.state_dict.get_model_state_dict(..., full_state_dict=True)``.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from titan_deepseek_v3.config import DeepSeekV3Config
from titan_plugins.errors import ConfigError

# HF name (with {} for the layer) -> TorchTitan/our name, for everything but routed experts.
_HF_LAYER = {
    "self_attn.q_proj.weight": "attention.wq.weight",
    "self_attn.q_a_proj.weight": "attention.wq_a.weight",
    "self_attn.q_a_layernorm.weight": "attention.q_norm.weight",
    "self_attn.q_b_proj.weight": "attention.wq_b.weight",
    "self_attn.kv_a_proj_with_mqa.weight": "attention.wkv_a.weight",
    "self_attn.kv_a_layernorm.weight": "attention.kv_norm.weight",
    "self_attn.kv_b_proj.weight": "attention.wkv_b.weight",
    "self_attn.o_proj.weight": "attention.wo.weight",
    "mlp.gate_proj.weight": "feed_forward.w1.weight",
    "mlp.up_proj.weight": "feed_forward.w3.weight",
    "mlp.down_proj.weight": "feed_forward.w2.weight",
    "input_layernorm.weight": "attention_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate.weight": "moe.router.gate.weight",
    "mlp.gate.e_score_correction_bias": "moe.expert_bias",
    "mlp.shared_experts.gate_proj.weight": "moe.shared_experts.w1.weight",
    "mlp.shared_experts.up_proj.weight": "moe.shared_experts.w3.weight",
    "mlp.shared_experts.down_proj.weight": "moe.shared_experts.w2.weight",
}
_HF_EXPERT = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
_HF_TOP = {
    "model.embed_tokens.weight": "tok_embeddings.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "lm_head.weight",
}
_OURS_TO_TT = {"lm_head.weight": "output.weight"}

_LAYER_RE = re.compile(r"^layers\.(\d+)\.(.+)$")
_HF_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_HF_EXPERT_RE = re.compile(r"^mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


class DeepSeekV3StateDictAdapter:
    """``to_torchtitan`` / ``from_torchtitan`` / ``to_hf`` / ``from_hf``; each returns a
    new dict sharing the tensors where no reshaping is needed."""

    def __init__(self, config: DeepSeekV3Config):
        self.config = config
        self._layer_to_hf = {ours: hf for hf, ours in _HF_LAYER.items()}
        self._top_to_hf = {ours: hf for hf, ours in _HF_TOP.items()}

    # ---------------------------------------------------------------- TorchTitan
    def to_torchtitan(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        return {_OURS_TO_TT.get(k, k): v for k, v in state_dict.items()}

    def from_torchtitan(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        back = {tt: ours for ours, tt in _OURS_TO_TT.items()}
        return {back.get(k, k): v for k, v in state_dict.items()}

    # ---------------------------------------------------------------- Hugging Face
    def to_hf(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in state_dict.items():
            if key in self._top_to_hf:
                out[self._top_to_hf[key]] = value
                continue
            match = _LAYER_RE.match(key)
            if match is None:
                raise KeyError(f"to_hf: no Hugging Face name for {key!r}")
            layer, rest = match.groups()
            if rest.startswith("moe.experts."):
                w = rest.rsplit(".", 1)[1]
                hf_proj = {v: k for k, v in _HF_EXPERT.items()}[w]
                for e in range(value.shape[0]):
                    out[f"model.layers.{layer}.mlp.experts.{e}.{hf_proj}.weight"] = value[e]
            elif rest in self._layer_to_hf:
                out[f"model.layers.{layer}.{self._layer_to_hf[rest]}"] = value
                if rest == "moe.router.gate.weight" and self.config.layer.moe.load_balance_coeff is None:
                    # no expert_bias here (balancing off): Hugging Face's is then zero
                    num_experts = value.shape[0]
                    out[f"model.layers.{layer}.mlp.gate.e_score_correction_bias"] = torch.zeros(
                        num_experts, dtype=torch.float32, device=value.device
                    )
            else:
                raise KeyError(f"to_hf: no Hugging Face name for {key!r}")
        return out

    def from_hf(self, hf_state_dict: dict[str, Any]) -> dict[str, Any]:
        """Hugging Face names -> ours. Layers at or past ``n_layers`` (DeepSeek-V3's
        multi-token-prediction layer 61) and rotary caches are skipped; fp8 weights
        with ``weight_scale_inv`` must be dequantized first. With balancing off
        (``load_balance_coeff=None``, no ``expert_bias``) a zero
        ``e_score_correction_bias`` is dropped, any other is an error."""
        num_experts = self.config.layer.moe.num_experts
        out: dict[str, Any] = {}
        experts: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
        for key, value in hf_state_dict.items():
            if key.endswith("weight_scale_inv"):
                raise ValueError(
                    f"from_hf: {key!r} belongs to an fp8-quantized checkpoint; dequantize it first"
                )
            if key.endswith("rotary_emb.inv_freq"):
                continue
            if key in _HF_TOP:
                out[_HF_TOP[key]] = value
                continue
            match = _HF_LAYER_RE.match(key)
            if match is None:
                raise KeyError(f"from_hf: unknown Hugging Face key {key!r}")
            layer, rest = match.groups()
            if int(layer) >= self.config.n_layers:
                continue
            expert = _HF_EXPERT_RE.match(rest)
            if expert is not None:
                e, proj = expert.groups()
                experts.setdefault((layer, _HF_EXPERT[proj]), {})[int(e)] = value
            elif rest == "mlp.gate.e_score_correction_bias" and self.config.layer.moe.load_balance_coeff is None:
                if bool(value.any()):  # it steers the routing: never drop it silently
                    raise ConfigError(
                        f"model.layer.moe.load_balance_coeff=None: the model has no expert_bias for {key!r}; "
                        "set a load_balance_coeff to keep the checkpoint's routing bias"
                    )
            elif rest in _HF_LAYER:
                out[f"layers.{layer}.{_HF_LAYER[rest]}"] = value
            else:
                raise KeyError(f"from_hf: unknown Hugging Face key {key!r}")
        for (layer, w), by_expert in experts.items():
            if sorted(by_expert) != list(range(num_experts)):
                raise KeyError(
                    f"from_hf: layer {layer} {w}: experts {sorted(by_expert)} given, "
                    f"model.layer.moe.num_experts={num_experts} expected"
                )
            out[f"layers.{layer}.moe.experts.{w}"] = torch.stack([by_expert[e] for e in range(num_experts)])
        return out
