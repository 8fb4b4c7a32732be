"""Attention masks from token ids: causal, document (``block_causal``) and chunked.

TorchTitan's ``block_causal`` mask lets a token attend to earlier tokens of its own
document only; a document ends at (and includes) its ``eos_id`` token. Llama 4's
iRoPE layers further restrict attention to fixed chunks of the sequence.

Each mask comes in the two forms the kernels take: a boolean ``[B, 1, S, S]``
tensor for SDPA (True = attend) and a flex attention ``BlockMask``. Both are
evaluated from the same predicate, so the two kernels compute the same function.

Packed conversations carry their document ids beside the tokens (an end-of-turn
token inside a conversation is no boundary): the trainer sets them with
``documents(doc_ids)`` around the forward, and ``document_ids`` returns them in
place of the ids found from ``eos_id``, so every model that builds a
``block_causal`` mask from ``document_ids`` honours them without a new argument.

Under context parallelism (``cp_attention``: a sequence shard in flight) the tokens are
this rank's load-balanced positions: ``document_ids`` numbers documents over the whole
row, and ``dense_mask`` masks this rank's queries (their global positions) against
every key of the row, with the whole row's document ids.

The enum is importable without torch (model configs live in Hydra schemas); the
builders import torch when called.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from enum import Enum
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch.nn.attention.flex_attention import BlockMask

__all__ = ["AttentionMask", "Documents", "document_ids", "documents", "dense_mask", "block_mask"]


class AttentionMask(str, Enum):
    """``causal``; ``block_causal``: causal within documents, which end at ``eos_id``
    (or are given by ``documents()``: packed conversations)."""

    causal = "causal"
    block_causal = "block_causal"


class Documents:
    """The document ids ``[B, S]`` of the batch in flight; ``used`` turns True when a
    model's ``document_ids`` call took them (the trainer refuses a packed batch that
    no mask consulted: its conversations would attend to each other)."""

    def __init__(self, ids: torch.Tensor) -> None:
        self.ids, self.used = ids, False


_DOCUMENTS: ContextVar[Documents | None] = ContextVar("titan_document_ids", default=None)


@contextlib.contextmanager
def documents(ids: torch.Tensor | None) -> Iterator[Documents | None]:
    """While active, ``document_ids`` returns ``ids`` (per token, its document index in
    the row) for tokens of their shape; ``None``: no-op (documents from ``eos_id``)."""
    if ids is None:
        yield None
        return
    docs = Documents(ids)
    token = _DOCUMENTS.set(docs)
    try:
        yield docs
    finally:
        _DOCUMENTS.reset(token)


def _given(tokens: Any) -> torch.Tensor | None:
    docs = _DOCUMENTS.get()
    if docs is None:
        return None
    if tuple(docs.ids.shape) != tuple(tokens.shape[:2]):
        raise ValueError(
            f"packed documents: the batch's document ids have shape {tuple(docs.ids.shape)} but the "
            f"model asked for tokens of shape {tuple(tokens.shape[:2])} (call document_ids on the "
            "whole batch, e.g. in the pipeline's stage_inputs, not per microbatch)"
        )
    docs.used = True
    return docs.ids.to(tokens.device)


def document_ids(tokens: torch.Tensor, eos_id: int) -> torch.Tensor:
    """Per token, the index of its document in the row: the ids set by ``documents()``
    if any, else found from the tokens (an EOS ends its document)."""
    import torch

    from titan_plugins.components.cp_attention import current_shard

    given = _given(tokens)
    if given is not None:
        return given

    eos = (tokens == eos_id).to(torch.int32)
    shard = current_shard()
    if shard is not None:  # context parallel: count the EOS of the whole row, keep this rank's
        eos = shard.gather_ids(eos)
        return shard.local(torch.cumsum(eos, dim=1) - eos)
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
    """Boolean SDPA mask ``[B, 1, S, S]`` (``B`` = 1 without documents); under context
    parallelism ``[B, 1, S / cp, S]``, this rank's queries against the whole row."""
    import torch

    from titan_plugins.components.cp_attention import current_shard

    shard = current_shard()
    if shard is not None:
        doc = None if doc is None else shard.gather_ids(doc)
        q = shard.positions(device).view(1, 1, -1, 1)
        seqlen = shard.seq_len
    else:
        q = torch.arange(seqlen, device=device).view(1, 1, seqlen, 1)
    batch = 1 if doc is None else doc.shape[0]
    b = torch.arange(batch, device=device).view(batch, 1, 1, 1)
    kv = torch.arange(seqlen, device=device).view(1, 1, 1, seqlen)
    return _predicate(doc, chunk)(b, None, q, kv)


def block_mask(
    doc: torch.Tensor | None, seqlen: int, chunk: int | None, device: torch.device
) -> BlockMask:
    """The same mask as a flex attention ``BlockMask`` (not under context parallelism)."""
    from torch.nn.attention.flex_attention import create_block_mask

    from titan_plugins.components.cp_attention import current_shard

    if current_shard() is not None:
        raise ValueError("context parallel: flex BlockMasks do not run under cp (use dense_mask)")

    batch = None if doc is None else doc.shape[0]
    return create_block_mask(_predicate(doc, chunk), batch, None, seqlen, seqlen, device=device)
