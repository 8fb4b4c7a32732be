"""What context parallelism (``parallelism.cp``) adds to a rank's plan.

A rank computes ``T = b * s / cp`` tokens (its load-balanced chunks of every row), so
every per-token activation of ``activations.py`` already shrinks by ``cp`` once the
tokens are counted that way. What CP adds, per attention block and pass
(``titan_plugins.components.cp_attention``):

- the gathered keys and values of the whole row, ``b * s * (k + v)`` elements in the
  compute dtype, kept for backward by SDPA (``k``/``v`` the block's local widths:
  ``wk``/``wv`` (transformers' ``k_proj``/``v_proj``) outputs, or MLA's per-head
  ``qk_nope + qk_rope`` and ``v_head_dim`` from ``wkv_b`` (``kv_b_proj``));
- the boolean mask of the local queries against the row, ``b * (s / cp) * s`` bytes
  (``b`` = 1 without documents), built once per forward;
- on the ``cp`` mesh: an all-gather of those keys and values in forward (again in the
  recompute of a checkpointed block) and a reduce-scatter of their gradients in backward.

A block whose attention has none of those projections (``kv_width``) cannot be sized:
the plan refuses in one line rather than guess.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from titan_plugins.errors import ConfigError
from titan_plugins.plan.sharding import model_parallel_shape

__all__ = ["kv_width", "mask_bytes"]


def _out(linear: Any) -> int:
    return int(model_parallel_shape(linear.weight)[0])


def _linear(module: nn.Module, *names: str) -> nn.Linear | None:
    found = [getattr(module, n, None) for n in names]
    return next((m for m in found if isinstance(m, nn.Linear)), None)


def kv_width(block: nn.Module, model: str) -> int:
    """Local ``k + v`` elements per token of ``block``'s attention (TP-local heads): the
    core's ``wk``/``wv`` and MLA's ``wkv_b``, transformers' ``k_proj``/``v_proj``, MLA's
    ``kv_b_proj`` and a fused ``qkv_proj`` (its k and v share of the heads, from the config)."""
    for module in block.modules():
        wk, wv = _linear(module, "wk", "k_proj"), _linear(module, "wv", "v_proj")
        if wk is not None and wv is not None:
            return _out(wk) + _out(wv)
        wkv_b = _linear(module, "wkv_b", "kv_b_proj")
        if wkv_b is not None and hasattr(module, "v_head_dim"):
            nope, rope, v = module.qk_nope_head_dim, module.qk_rope_head_dim, module.v_head_dim
            heads = _out(wkv_b) // (nope + v)
            return heads * (nope + rope + v)
        qkv, config = _linear(module, "qkv_proj"), getattr(module, "config", None)
        if qkv is not None and config is not None and hasattr(config, "num_attention_heads"):
            heads = int(config.num_attention_heads)
            kv = int(getattr(config, "num_key_value_heads", None) or heads)
            return _out(qkv) * 2 * kv // (heads + 2 * kv)
    raise ConfigError(f"plan=true with parallelism.cp: cannot size the key/value exchange of model={model} "
                      "(its attention has neither k/v projections nor MLA's kv_b)")


def mask_bytes(job: Any, batch: int, cp: int) -> int:
    """The boolean mask of one forward: ``[b or 1, 1, s / cp, s]``."""
    seq = int(job.training.seq_len)
    documents = str(getattr(job.model.get("attn_mask", "causal"), "value", job.model.get("attn_mask"))) == "block_causal"
    return (batch if documents else 1) * (seq // cp) * seq
