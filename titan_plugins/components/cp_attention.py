"""Attention, positions and masks over a sequence sharded across context-parallel ranks.

Under context parallelism (``parallelism.cp``) each row of ``S`` tokens is cut into
``2 * cp`` chunks of ``S / (2 cp)`` tokens; rank ``r`` of the cp group holds chunk ``r``
and chunk ``2 cp - 1 - r`` (a head chunk and its mirror tail), so that every rank has
the same causal work. Queries stay on their rank. In every attention layer the keys
and values are all-gathered over the cp group (``all_gather_single_autograd``: its
backward reduce-scatters their gradients), put back in global order, and SDPA runs on
plain local tensors with the mask of the local queries' global positions against
every key of the row: causal, and the document (``block_causal``) and chunk masks from
the same predicate as one rank's (``attention_masks.dense_mask``, whose document ids
are gathered with the keys).

Why an all-gather and not a ring (send/recv of K/V chunks with an online-softmax
merge): the gathered form reuses SDPA's forward and backward as they are, on every
kernel and device, and sums each softmax in the one-rank order (the keys in global
order), so a layout change is only float reordering; the ring needs its own
log-sum-exp merge in forward and backward and overlaps communication only where
send/recv runs beside compute (not gloo on a CPU). The price is memory: a rank holds
the whole row's keys and values of one layer (``cp`` times its own) while it
attends, small beside the other activations with grouped heads (kv_heads < heads)
or MLA. The mask is a boolean ``[batch or 1, 1, S / cp, S]`` tensor (SDPA; flex
attention is not used under CP).

The state (this rank's place, the group, the row length) is a context variable the
train step sets around each microbatch (``titan_plugins.distributed.context_parallel``).
Without it every helper here is the identity and ``attend`` takes its plain path.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch.distributed import ProcessGroup

__all__ = [
    "SequenceShard", "attend_sharded", "current_shard", "global_seq_len", "load_balanced_positions",
    "owns_rows", "rope_rows", "row_sum", "shard_sequence", "sharded_sequence", "token_positions",
    "unshard_sequence",
]


def load_balanced_positions(seq_len: int, cp: int, rank: int, device: Any = None) -> torch.Tensor:
    """The global positions rank ``rank`` of ``cp`` holds: chunk ``rank`` then chunk
    ``2 cp - 1 - rank`` of ``2 cp`` equal chunks (int64, ``seq_len / cp`` of them)."""
    import torch

    if seq_len % (2 * cp):
        raise ValueError(f"context parallel: a sequence of {seq_len} tokens does not split into "
                         f"2*cp={2 * cp} equal chunks")
    chunk = seq_len // (2 * cp)
    head = torch.arange(rank * chunk, (rank + 1) * chunk, device=device)
    return torch.cat([head, head + (2 * cp - 1 - 2 * rank) * chunk])


def shard_sequence(x: torch.Tensor, dim: int, cp: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s load-balanced shard of ``x`` along ``dim`` (the whole row there)."""
    return x.index_select(dim, load_balanced_positions(x.shape[dim], cp, rank, x.device))


def _global_order(seq_len: int, cp: int, device: Any) -> torch.Tensor:
    """For each global position, its index in the rank-major concatenation of the shards."""
    import torch

    held = torch.cat([load_balanced_positions(seq_len, cp, r, device) for r in range(cp)])
    return torch.argsort(held)


def unshard_sequence(shards: list[torch.Tensor], dim: int) -> torch.Tensor:
    """The whole row from every rank's shard (rank order), in global order."""
    import torch

    joined = torch.cat(shards, dim)
    return joined.index_select(dim, _global_order(joined.shape[dim], len(shards), joined.device))


@dataclass(frozen=True, eq=False)
class SequenceShard:
    """This rank's part of every row: ``rank`` of a cp group of ``size`` ranks
    (``group``), rows of ``seq_len`` tokens. Hashable by identity (a cache key)."""

    group: ProcessGroup
    rank: int
    size: int
    seq_len: int
    _cache: dict = field(default_factory=dict, repr=False)

    @property
    def local_len(self) -> int:
        return self.seq_len // self.size

    def _cached(self, key: Any, make: Any) -> Any:
        if key not in self._cache:
            self._cache[key] = make()
        return self._cache[key]

    def positions(self, device: Any) -> torch.Tensor:
        """The global positions of this rank's tokens, in local order."""
        return self._cached(("pos", str(device)), lambda: load_balanced_positions(
            self.seq_len, self.size, self.rank, device))

    def local(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's shard of a whole-row tensor ``x`` (global order along ``dim``)."""
        return x.index_select(dim, self.positions(x.device))

    def gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """Every rank's shard of ``x`` along ``dim``, the whole row in global order; the
        backward sends each rank its shard's gradient summed over the group."""
        from torch.distributed._functional_collectives import all_gather_single_autograd

        gathered = all_gather_single_autograd(x.contiguous(), 0, self.group)  # rank-major on dim 0
        gathered = gathered.view(self.size, *x.shape).movedim(0, dim).flatten(dim, dim + 1)
        order = self._cached(("order", str(x.device)), lambda: _global_order(self.seq_len, self.size, x.device))
        return gathered.index_select(dim, order)

    def gather_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """The whole rows ``[batch, S]`` of integer ids ``[batch, S / cp]`` (no gradient).
        The last gathered tensor is kept: every layer asking for the same ids costs
        one gather per forward."""
        import torch

        last = self._cache.get("ids")
        if last is not None and last[0] is ids:
            return last[1]
        with torch.no_grad():
            whole = self.gather(ids, 1)
        self._cache["ids"] = (ids, whole)
        return whole

    def causal_mask(self, device: Any) -> torch.Tensor:
        """Boolean ``[1, 1, S / cp, S]``: each local query against every key of the row."""
        import torch

        def make() -> torch.Tensor:
            keys = torch.arange(self.seq_len, device=device)
            return (self.positions(device).view(-1, 1) >= keys.view(1, -1)).view(1, 1, self.local_len, -1)

        return self._cached(("causal", str(device)), make)


_SHARD: ContextVar[SequenceShard | None] = ContextVar("titan_sequence_shard", default=None)


@contextlib.contextmanager
def sharded_sequence(shard: SequenceShard | None) -> Iterator[SequenceShard | None]:
    """While active, the model's inputs are ``shard``'s part of each row (None: no-op)."""
    if shard is None:
        yield None
        return
    token = _SHARD.set(shard)
    try:
        yield shard
    finally:
        _SHARD.reset(token)


def current_shard() -> SequenceShard | None:
    """The sequence shard of the forward in flight (None: whole rows)."""
    return _SHARD.get()


def row_sum(x: torch.Tensor) -> torch.Tensor:
    """Per-row values of this rank's tokens (a row's summed log-probs, its token count)
    summed over the cp group: the whole row's. Differentiable: the backward sums the
    gradients the cp peers send back, so a per-row loss computed on one rank of the group
    (:func:`owns_rows`) reaches every rank's tokens. Unchanged without a shard."""
    shard = _SHARD.get()
    if shard is None:
        return x
    from torch.distributed.nn.functional import all_reduce

    return all_reduce(x, group=shard.group)


def owns_rows() -> bool:
    """Whether this rank reports per-row terms (a sequence-level loss, pairs counted):
    every rank without CP; under CP the group's rank 0 only, so that summing the loss and
    the counts over the cp group (as token-level ones are) counts each row once."""
    shard = _SHARD.get()
    return shard is None or shard.rank == 0


def global_seq_len(local: int) -> int:
    """The row length the model's ``local`` positions belong to."""
    shard = _SHARD.get()
    if shard is None:
        return local
    if local != shard.local_len:
        raise ValueError(f"context parallel: {local} positions on this rank, expected {shard.local_len} "
                         f"(rows of {shard.seq_len} over cp={shard.size})")
    return shard.seq_len


def token_positions(seq: int, device: Any) -> torch.Tensor:
    """The global positions of the ``seq`` tokens in flight: ``0..seq-1``, or this
    rank's load-balanced positions under context parallelism."""
    import torch

    shard = _SHARD.get()
    return torch.arange(seq, device=device) if shard is None else shard.positions(device)


def rope_rows(table: torch.Tensor) -> torch.Tensor:
    """A rotary table (``[max_seq_len, ...]``, a plain tensor) as the model's rotary
    code reads it (its first ``seq`` rows): unchanged, or under context parallelism
    the rows of this rank's global positions, in local order."""
    shard = _SHARD.get()
    if shard is None:
        return table
    return table.index_select(0, shard.positions(table.device))


def attend_sharded(
    shard: SequenceShard, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any,
    scale: float | None, enable_gqa: bool,
) -> torch.Tensor:
    """SDPA of the local queries ``[B, H, S / cp, D]`` against the gathered keys and
    values; ``mask`` None (causal) or a boolean mask over the whole row's keys."""
    import torch
    import torch.nn.functional as F

    if q.shape[2] != shard.local_len or k.shape[2] != shard.local_len:
        raise ValueError(
            f"context parallel: attention over {q.shape[2]} queries and {k.shape[2]} keys, but this rank "
            f"holds {shard.local_len} positions (decoding with a KV cache does not run under cp)")
    if mask is None:
        mask = shard.causal_mask(q.device)
    elif not isinstance(mask, torch.Tensor) or mask.shape[-1] != shard.seq_len:
        raise ValueError(
            "context parallel: the attention mask must be a boolean tensor over the whole row's "
            f"{shard.seq_len} keys (attention_masks.dense_mask builds it; flex BlockMasks do not run under cp)")
    k, v = shard.gather(k, 2), shard.gather(v, 2)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=enable_gqa)
