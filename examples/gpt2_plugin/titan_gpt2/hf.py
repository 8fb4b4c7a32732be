"""GPT-2 <-> Hugging Face ``GPT2LMHeadModel``: config.json mapping and state-dict
names. Hugging Face keeps GPT-2's Conv1D layout (weights ``[in, out]``) and one
fused ``c_attn`` for q, k and v; this model keeps ``nn.Linear`` (``[out, in]``) and
separate ``wq``/``wk``/``wv`` (a fused projection shards badly under column-wise TP).
"""

from __future__ import annotations

from typing import Any

from titan_gpt2.config import GPT2Config
from titan_plugins.hf.config import Field, HFConfigMap
from titan_plugins.hf.mapping import Fuse, HFMapping, MappedAdapter, Rename, Transpose

__all__ = ["MAPPING", "GPT2StateDictAdapter", "config_from_hf", "config_to_hf"]

_ACT = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}
MAP = HFConfigMap(
    "gpt2",
    fields=[Field("n_embd", "dim"), Field("n_layer", "n_layers"), Field("n_head", "n_heads"),
            Field("vocab_size", "vocab_size"), Field("n_positions", "max_seq_len"),
            Field("layer_norm_epsilon", "norm_eps", float)],
    fixed={"scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
           "reorder_and_upcast_attn": False, "add_cross_attention": False, "tie_word_embeddings": False,
           "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0},
    # sequence-classification head settings: GPT2LMHeadModel has no such head
    no_effect={"summary_type", "summary_use_proj", "summary_activation", "summary_proj_to_labels",
               "summary_first_dropout"},
)


def config_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    if hf.get("model_type") != "gpt2":
        raise MAP.bad("model_type", hf.get("model_type"), "the gpt2 example reads gpt2 folders only")
    if hf.get("tie_word_embeddings"):
        raise MAP.bad("tie_word_embeddings", True, "this model's output projection is untied")
    out, used = MAP.read(hf)
    act = hf.get("activation_function", "gelu_new")
    if act not in _ACT:
        raise MAP.bad("activation_function", act, f"this model implements {', '.join(_ACT)}")
    out["activation"] = _ACT[act]
    if hf.get("n_inner") is not None:
        dim = int(hf.get("n_embd", 768))
        if hf["n_inner"] % dim:
            raise MAP.bad("n_inner", hf["n_inner"], f"must be a multiple of n_embd={dim} (model.mlp_ratio)")
        out["mlp_ratio"] = hf["n_inner"] // dim
    return MAP.finish(hf, used | {"activation_function", "n_inner"}, out)


def config_to_hf(config: GPT2Config) -> dict[str, Any]:
    c = config
    return {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", **MAP.write(c),
        "n_inner": c.mlp_ratio * c.dim,
        "activation_function": "gelu_new" if c.activation.value == "gelu_tanh" else "gelu",
    }


_L, _HF = "layers.{L}.", "transformer.h.{L}."
MAPPING = HFMapping(
    Rename("tok_embeddings.weight", "transformer.wte.weight"),
    Rename("pos_embeddings.weight", "transformer.wpe.weight"),
    Rename("norm.weight", "transformer.ln_f.weight"),
    Rename("norm.bias", "transformer.ln_f.bias"),
    Rename("output.weight", "lm_head.weight"),
    *(Rename(f"{_L}{ours}.{kind}", f"{_HF}{hf}.{kind}") for ours, hf in (("attention_norm", "ln_1"),
      ("ffn_norm", "ln_2")) for kind in ("weight", "bias")),
    *(Rename(f"{_L}{ours}.bias", f"{_HF}{hf}.bias") for ours, hf in (("attention.wo", "attn.c_proj"),
      ("feed_forward.fc", "mlp.c_fc"), ("feed_forward.proj", "mlp.c_proj"))),
    # Conv1D keeps [in, out]: the same weights transposed
    *(Rename(f"{_L}{ours}.weight", f"{_HF}{hf}.weight", Transpose()) for ours, hf in (
      ("attention.wo", "attn.c_proj"), ("feed_forward.fc", "mlp.c_fc"), ("feed_forward.proj", "mlp.c_proj"))),
    # one c_attn for q, k and v: [in, 3 * out] (each transposed), biases [3 * out]
    Fuse(_HF + "attn.c_attn.weight", [f"{_L}attention.{w}.weight" for w in ("wq", "wk", "wv")], dim=1,
         transform=Transpose()),
    Fuse(_HF + "attn.c_attn.bias", [f"{_L}attention.{w}.bias" for w in ("wq", "wk", "wv")], dim=0),
)


class GPT2StateDictAdapter(MappedAdapter):
    mapping = MAPPING
