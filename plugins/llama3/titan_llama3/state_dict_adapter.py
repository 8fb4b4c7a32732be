"""State-dict names: TorchTitan (identical to ours) and Hugging Face ``LlamaForCausalLM``.

Our parameter names and rotary layout are TorchTitan v0.2.2's: adjacent pairs of a head
rotate together. Hugging Face's Llama rotates the two halves of a head, so its
``q_proj``/``k_proj`` rows (and biases) are permuted within each head, exactly as
TorchTitan's ``Llama3StateDictAdapter`` (and Meta's conversion script) do: a declared
``RotaryPermute`` in ``MAPPING`` (``titan_plugins.hf.mapping``), from which both
directions and the sharded load's read plan follow.
"""

from __future__ import annotations

from titan_plugins.hf.mapping import HFMapping, MappedAdapter, Rename, RotaryPermute, Tied

__all__ = ["MAPPING", "Llama3StateDictAdapter"]

_L, _HF = "layers.{L}.", "model.layers.{L}."
# q/k rows are permuted between the two rotary layouts: the heads each has
_ROTARY = {"wq": RotaryPermute("n_heads"), "wk": RotaryPermute("kv_heads")}

MAPPING = HFMapping(
    Rename("tok_embeddings.weight", "model.embed_tokens.weight"),
    Rename("norm.weight", "model.norm.weight"),
    Tied("output.weight", "tok_embeddings.weight", when=lambda c: c.enable_weight_tying),
    Rename("output.weight", "lm_head.weight"),
    Rename(_L + "attention_norm.weight", _HF + "input_layernorm.weight"),
    Rename(_L + "ffn_norm.weight", _HF + "post_attention_layernorm.weight"),
    *(Rename(f"{_L}feed_forward.{w}.weight", f"{_HF}mlp.{hf}.weight")
      for w, hf in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj"))),
    *(Rename(f"{_L}attention.{ours}.{kind}", f"{_HF}self_attn.{hf}.{kind}", _ROTARY.get(ours))
      for ours, hf in (("wq", "q_proj"), ("wk", "k_proj"), ("wv", "v_proj"), ("wo", "o_proj"))
      for kind in ("weight", "bias")),
    skip=[r".*freqs_cis"],
    ignore_hf=[r".*rotary_emb\.inv_freq"],
)


class Llama3StateDictAdapter(MappedAdapter):
    """Converts model state dicts; constructed with the model's ``Llama3Config``."""

    mapping = MAPPING
