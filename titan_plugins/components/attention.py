"""The attention kernel choice the first-party models share: backend enum, flex cache, call.

The enum is importable without torch (model configs live in Hydra schemas); the
functions import torch when called. ``auto`` picks flex attention where it has a
backward (CUDA) and SDPA elsewhere; ``flex`` on CPU runs forward only. Under context
parallelism (a sequence shard in flight, ``cp_attention``) ``attend`` gathers the keys
and values of the whole row and runs SDPA; flex is not used.
"""

from __future__ import annotations

import functools
from enum import Enum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from torch.nn.attention.flex_attention import BlockMask

__all__ = ["AttentionBackend", "attend", "flex_kernel", "use_flex"]


class AttentionBackend(str, Enum):
    """``auto``: flex attention on CUDA, SDPA elsewhere; ``sdpa``; ``flex``.

    Both kernels compute the same function from the same mask predicate.
    """

    auto = "auto"
    sdpa = "sdpa"
    flex = "flex"


def use_flex(backend: AttentionBackend | str, device: torch.device) -> bool:
    """Whether ``backend`` runs flex attention on ``device`` (a plain string works too);
    never under context parallelism (SDPA with a boolean mask there)."""
    from titan_plugins.components.cp_attention import current_shard

    if current_shard() is not None:
        return False
    if backend == AttentionBackend.auto:
        return device.type == "cuda"
    return backend == AttentionBackend.flex


@functools.cache
def _compiled_flex():
    import torch
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention)


def flex_kernel(device: torch.device):
    """flex attention, compiled once per process on CUDA, eager elsewhere (torch has
    no compiled CPU path worth the compile time, and no CPU backward at all)."""
    if device.type == "cuda":
        return _compiled_flex()
    from torch.nn.attention.flex_attention import flex_attention

    return flex_attention


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | BlockMask | None,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """Attention on ``[B, H, S, D]``: flex for a ``BlockMask``, else SDPA with the boolean
    ``mask`` (True = attend) or, for None, SDPA's ``is_causal``. Under context
    parallelism ``q``/``k``/``v`` are this rank's positions and the mask (None: causal)
    covers the whole row's keys (``cp_attention.attend_sharded``)."""
    import torch.nn.functional as F
    from torch.nn.attention.flex_attention import BlockMask

    from titan_plugins.components.cp_attention import attend_sharded, current_shard

    shard = current_shard()
    if shard is not None:
        return attend_sharded(shard, q, k, v, mask, scale, enable_gqa)
    if isinstance(mask, BlockMask):
        return flex_kernel(q.device)(q, k, v, block_mask=mask, scale=scale, enable_gqa=enable_gqa)
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=enable_gqa
    )
