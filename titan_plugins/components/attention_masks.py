"""Attention masks from token ids: causal, document (``block_causal``) and chunked.

TorchTitan's ``block_causal`` mask lets a token attend to earlier tokens of its own
document only; a document ends at (and includes) its ``eos_id`` token. Llama 4's
iRoPE layers further restrict attention to fixed chunks of the sequence.

Each mask comes in the two forms the kernels take: a boolean ``[B, 1, S, S]``
tensor for SDPA (True = attend) and a flex attention ``BlockMask``. Both are
evaluated from the same predicate, so the two kernels compute the same function.

The enum is importable without torch (model configs live in Hydra schemas); the
builders import torch when called.
"""

from __future__ import annotations

from enum import Enum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from torch.nn.attention.flex_attention import BlockMask

__all__ = ["AttentionMask", "document_ids", "dense_mask", "block_mask"]


class AttentionMask(str, Enum):
    """``causal``; ``block_causal``: causal within documents, which end at ``eos_id``."""

    causal = "causal"
    block_causal = "block_causal"


def document_ids(tokens: torch.Tensor, eos_id: int) -> torch.Tensor:
    """Per token, the index of its document in the row (an EOS ends its document)."""
    import torch

    eos = (tokens == eos_id).to(torch.int32)
    return torch.cumsum(eos, dim=1) - eos


def _predicate(doc: torch.Tensor | None, chunk: int | None):
    def allowed(b, h, q, kv):
        ok = q >= kv
        if doc is not None:
            ok = ok & (doc[b, q] == doc[b, kv])
        if chunk is not None:
            ok = ok & (q // chunk == kv // chunk)
        return ok

    return allowed


def dense_mask(
    doc: torch.Tensor | None, seqlen: int, chunk: int | None, device: torch.device
) -> torch.Tensor:
    """Boolean SDPA mask ``[B, 1, S, S]`` (``B`` = 1 without documents)."""
    import torch

    batch = 1 if doc is None else doc.shape[0]
    b = torch.arange(batch, device=device).view(batch, 1, 1, 1)
    q = torch.arange(seqlen, device=device).view(1, 1, seqlen, 1)
    kv = torch.arange(seqlen, device=device).view(1, 1, 1, seqlen)
    return _predicate(doc, chunk)(b, None, q, kv)


def block_mask(
    doc: torch.Tensor | None, seqlen: int, chunk: int | None, device: torch.device
) -> BlockMask:
    """The same mask as a flex attention ``BlockMask``."""
    from torch.nn.attention.flex_attention import create_block_mask

    batch = None if doc is None else doc.shape[0]
    return create_block_mask(_predicate(doc, chunk), batch, None, seqlen, seqlen, device=device)
