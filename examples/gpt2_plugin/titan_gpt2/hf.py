"""GPT-2 <-> Hugging Face ``GPT2LMHeadModel``: config.json mapping and state-dict
names. Hugging Face keeps GPT-2's Conv1D layout (weights ``[in, out]``) and one
fused ``c_attn`` for q, k and v; this model keeps ``nn.Linear`` (``[out, in]``) and
separate ``wq``/``wk``/``wv`` (a fused projection shards badly under column-wise TP).
"""

from __future__ import annotations

import re
from typing import Any

from titan_gpt2.config import GPT2Config
from titan_plugins.errors import ConfigError

__all__ = ["GPT2StateDictAdapter", "config_from_hf", "config_to_hf"]

_ACT = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}
_NO_EFFECT = {
    "architectures", "model_type", "transformers_version", "dtype", "torch_dtype", "_name_or_path",
    "output_hidden_states", "output_attentions", "return_dict", "chunk_size_feed_forward",
    "is_encoder_decoder", "id2label", "label2id", "problem_type", "use_cache", "initializer_range",
    "bos_token_id", "eos_token_id", "pad_token_id",
    # sequence-classification head settings: GPT2LMHeadModel has no such head
    "summary_type", "summary_use_proj", "summary_activation", "summary_proj_to_labels", "summary_first_dropout",
}
_FIXED = {"scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False,
          "add_cross_attention": False, "tie_word_embeddings": False,
          "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}


def _bad(field: str, value: Any, why: str) -> ConfigError:
    return ConfigError(f"config.json: {field}={value!r}: {why}")


def config_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    if hf.get("model_type") != "gpt2":
        raise _bad("model_type", hf.get("model_type"), "the gpt2 example reads gpt2 folders only")
    for field, value in _FIXED.items():
        if field in hf and hf[field] != value:
            why = {"tie_word_embeddings": "this model's output projection is untied"}.get(
                field, f"this model implements only {value!r} (no dropout, plain scaled attention)")
            raise _bad(field, hf[field], why)
    act = hf.get("activation_function", "gelu_new")
    if act not in _ACT:
        raise _bad("activation_function", act, f"this model implements {', '.join(_ACT)}")
    mapping = {"n_embd": "dim", "n_layer": "n_layers", "n_head": "n_heads", "vocab_size": "vocab_size",
               "n_positions": "max_seq_len", "layer_norm_epsilon": "norm_eps"}
    out: dict[str, Any] = {ours: hf[k] for k, ours in mapping.items() if hf.get(k) is not None}
    out["activation"] = _ACT[act]
    if hf.get("n_inner") is not None:
        dim = int(hf.get("n_embd", 768))
        if hf["n_inner"] % dim:
            raise _bad("n_inner", hf["n_inner"], f"must be a multiple of n_embd={dim} (model.mlp_ratio)")
        out["mlp_ratio"] = hf["n_inner"] // dim
    unknown = sorted(set(hf) - set(mapping) - _NO_EFFECT - set(_FIXED) - {"activation_function", "n_inner"})
    if unknown:
        raise _bad(unknown[0], hf[unknown[0]], "not understood by the gpt2 example (it would be dropped)")
    return out


def config_to_hf(config: GPT2Config) -> dict[str, Any]:
    c = config
    return {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
        "vocab_size": c.vocab_size, "n_positions": c.max_seq_len, "n_embd": c.dim, "n_layer": c.n_layers,
        "n_head": c.n_heads, "n_inner": c.mlp_ratio * c.dim, "layer_norm_epsilon": c.norm_eps,
        "activation_function": "gelu_new" if c.activation.value == "gelu_tanh" else "gelu",
        **_FIXED,
    }


_PLAIN = {  # ours -> Hugging Face, same layout
    "tok_embeddings.weight": "transformer.wte.weight",
    "pos_embeddings.weight": "transformer.wpe.weight",
    "norm.weight": "transformer.ln_f.weight",
    "norm.bias": "transformer.ln_f.bias",
    "output.weight": "lm_head.weight",
    "attention_norm.weight": "ln_1.weight", "attention_norm.bias": "ln_1.bias",
    "ffn_norm.weight": "ln_2.weight", "ffn_norm.bias": "ln_2.bias",
    "attention.wo.bias": "attn.c_proj.bias",
    "feed_forward.fc.bias": "mlp.c_fc.bias",
    "feed_forward.proj.bias": "mlp.c_proj.bias",
}
_TRANSPOSED = {"attention.wo.weight": "attn.c_proj.weight", "feed_forward.fc.weight": "mlp.c_fc.weight",
               "feed_forward.proj.weight": "mlp.c_proj.weight"}
_QKV = ("attention.wq", "attention.wk", "attention.wv")
_LAYER = re.compile(r"(layers\.|transformer\.h\.)(\d+)\.(.+)")


class GPT2StateDictAdapter:
    def __init__(self, config: GPT2Config, hf_assets_path: str | None = None):
        self.config = config

    def to_torchtitan(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        return dict(state_dict)

    def from_torchtitan(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        return dict(state_dict)

    def to_hf(self, sd: dict[str, Any]) -> dict[str, Any]:
        """Hugging Face names; q/k/v fused into ``c_attn`` (so all three are needed)."""
        import torch

        out: dict[str, Any] = {}
        qkv: dict[tuple[str, str], dict[str, Any]] = {}
        for key, value in sd.items():
            m = _LAYER.fullmatch(key)
            if m is None:
                out[_PLAIN[key]] = value
                continue
            layer, rest = m.group(2), m.group(3)
            prefix = f"transformer.h.{layer}."
            proj, _, kind = rest.rpartition(".")
            if proj in _QKV:
                qkv.setdefault((layer, kind), {})[proj] = value
            elif rest in _TRANSPOSED:
                out[prefix + _TRANSPOSED[rest]] = value.t()
            else:
                out[prefix + _PLAIN[rest]] = value
        for (layer, kind), parts in qkv.items():
            if len(parts) != 3:
                raise KeyError(f"layers.{layer}: c_attn.{kind} needs wq, wk and wv together")
            tensors = [parts[p] for p in _QKV]
            fused = torch.cat([t.t() for t in tensors], dim=1) if kind == "weight" else torch.cat(tensors)
            out[f"transformer.h.{layer}.attn.c_attn.{kind}"] = fused
        return out

    def from_hf(self, hf: dict[str, Any]) -> dict[str, Any]:
        plain = {v: k for k, v in _PLAIN.items()}
        transposed = {v: k for k, v in _TRANSPOSED.items()}
        out: dict[str, Any] = {}
        for key, value in hf.items():
            m = _LAYER.fullmatch(key)
            if m is None:
                if key not in plain:
                    raise KeyError(f"unknown Hugging Face GPT-2 entry {key!r}")
                out[plain[key]] = value
                continue
            layer, rest = m.group(2), m.group(3)
            prefix = f"layers.{layer}."
            if rest.startswith("attn.c_attn."):
                kind = rest.rsplit(".", 1)[1]
                chunks = value.chunk(3, dim=1 if kind == "weight" else 0)
                for proj, chunk in zip(_QKV, chunks, strict=True):
                    out[f"{prefix}{proj}.{kind}"] = chunk.t().contiguous() if kind == "weight" else chunk
            elif rest in transposed:
                out[prefix + transposed[rest]] = value.t().contiguous()
            elif rest in plain:
                out[prefix + plain[rest]] = value
            else:
                raise KeyError(f"unknown Hugging Face GPT-2 entry {key!r}")
        return out
