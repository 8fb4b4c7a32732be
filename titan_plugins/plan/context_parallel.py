"""What context parallelism (``parallelism.cp``) adds to a rank's plan.

A rank computes ``T = b * s / cp`` tokens (its load-balanced chunks of every row), so
every per-token activation of ``activations.py`` already shrinks by ``cp`` once the
tokens are counted that way. What CP adds, per attention block and pass
(``titan_plugins.components.cp_attention``):

- the gathered keys and values of the whole row, ``b * s * (k + v)`` elements in the
  compute dtype, kept for backward by SDPA (``k``/``v`` the block's local widths:
  ``wk``/``wv`` outputs, or MLA's per-head ``qk_nope + qk_rope`` and ``v_head_dim``
  from ``wkv_b``);
- the boolean mask of the local queries against the row, ``b * (s / cp) * s`` bytes
  (``b`` = 1 without documents), built once per forward;
- on the ``cp`` mesh: an all-gather of those keys and values in forward (again in the
  recompute of a checkpointed block) and a reduce-scatter of their gradients in backward.

A block whose attention has neither ``wk``/``wv`` nor ``wkv_b`` cannot be sized: the
plan refuses in one line rather than guess.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from titan_plugins.errors import ConfigError
from titan_plugins.plan.sharding import model_parallel_shape

__all__ = ["kv_width", "mask_bytes"]


def _out(linear: Any) -> int:
    return int(model_parallel_shape(linear.weight)[0])


def kv_width(block: nn.Module, model: str) -> int:
    """Local ``k + v`` elements per token of ``block``'s attention (TP-local heads)."""
    for module in block.modules():
        wk, wv = getattr(module, "wk", None), getattr(module, "wv", None)
        if isinstance(wk, nn.Linear) and isinstance(wv, nn.Linear):
            return _out(wk) + _out(wv)
        wkv_b = getattr(module, "wkv_b", None)
        if isinstance(wkv_b, nn.Linear) and hasattr(module, "v_head_dim"):
            nope, rope, v = module.qk_nope_head_dim, module.qk_rope_head_dim, module.v_head_dim
            heads = _out(wkv_b) // (nope + v)
            return heads * (nope + rope + v)
    raise ConfigError(f"plan=true with parallelism.cp: cannot size the key/value exchange of model={model} "
                      "(its attention has neither wk/wv nor MLA's wkv_b)")


def mask_bytes(job: Any, batch: int, cp: int) -> int:
    """The boolean mask of one forward: ``[b or 1, 1, s / cp, s]``."""
    seq = int(job.training.seq_len)
    documents = str(getattr(job.model.get("attn_mask", "causal"), "value", job.model.get("attn_mask"))) == "block_causal"
    return (batch if documents else 1) * (seq // cp) * seq
