"""The stream-per-row layout: rows of the global batch dealt to ranks, microbatches
and loader workers without changing what any row holds (``RowStream``), and the
identity a resumed state must match (``check_identity``).

Row ``i`` of the run is a function of ``i`` alone, so the global batch is the same
at any data-parallel degree and accumulation split; a resume at another degree or
split is refused in one line.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import torch

from titan_plugins.errors import ConfigError


def seeded_rng(*key: int) -> np.random.Generator:
    """A generator from ``key`` alone, so any rank and any resume draw the same numbers."""
    return np.random.default_rng([k & (2**64 - 1) for k in key])


class RowStream(torch.utils.data.IterableDataset):
    """The rows of the global batch, dealt to data-parallel ranks, accumulation
    microbatches and loader workers without changing what any row holds.

    Row ``i`` of the run (global batch ``t`` is rows ``t*G .. t*G+G-1``, ``G`` =
    ``dp_world x local_batch_size x grad_accum_steps``) is a function of ``i`` alone
    (``row(i)``). Rank ``r``'s ``n``-th local batch (microbatch ``n % accum`` of step
    ``n // accum``) is rows ``(n*dp_world + r)*b .. +b``; torch's loader hands batch
    ``n`` to worker ``n % num_workers``, so a worker knows which rows it owes. The
    state is the worker's own count of rows plus what ``row`` needs (subclasses)."""

    def __init__(self, *, dp_rank: int, dp_world: int, num_workers: int, seq_len: int) -> None:
        if seq_len < 1:
            raise ConfigError(f"training.seq_len={seq_len} must be at least 1")
        if not 0 <= dp_rank < dp_world:
            raise ValueError(f"dp_rank={dp_rank} is not in [0, dp_world={dp_world})")
        self.dp_rank, self.dp_world, self.num_workers = dp_rank, dp_world, max(1, num_workers)
        self.seq_len = seq_len
        self.block, self.accum = 1, 1  # the loader sets the local batch and accumulation
        self.taken = 0  # rows this worker has yielded

    @property
    def global_rows(self) -> int:
        return self.dp_world * self.block * self.accum

    def set_layout(self, local_batch_size: int, grad_accum_steps: int) -> None:
        self.block, self.accum = int(local_batch_size), max(1, int(grad_accum_steps))

    def row_of(self, taken: int, worker: int) -> int:
        """The run-wide row index of this worker's ``taken``-th row."""
        batch, j = divmod(taken, self.block)
        n = batch * self.num_workers + worker
        return (n * self.dp_world + self.dp_rank) * self.block + j

    def worker(self) -> int:
        info = torch.utils.data.get_worker_info()
        return info.id if info is not None else 0

    def row(self, index: int) -> Any:
        raise NotImplementedError

    def __iter__(self) -> Iterator[Any]:
        worker = self.worker()
        while True:
            sample = self.row(self.row_of(self.taken, worker))
            self.taken += 1
            yield sample

    def identity(self) -> dict[str, Any]:
        return {"seq_len": self.seq_len, "global_rows": self.global_rows, "dp_world": self.dp_world}


def check_identity(state: Mapping[str, Any], identity: Mapping[str, Any]) -> None:
    for key, value in identity.items():
        if state.get(key) != value:
            raise ConfigError(
                f"the checkpoint's data state has {key}={state.get(key)!r} but this run has "
                f"{value!r}: resume with the same data settings (and data.num_workers, data-parallel "
                "degree) or start a new run"
            )
