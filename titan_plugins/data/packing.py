"""Token stream datasets: packed windows of a token array, and random tokens.

Both are infinite streams of ``(input_ids, labels)`` int64 tensors of length
``seq_len``, sharded across data-parallel ranks the same way: the run's samples
are numbered 0, 1, 2, ... and dealt in blocks of ``block`` (the loader sets it
to the per-rank batch size): rank ``r`` takes block ``r`` of every run of
``dp_world`` blocks. So one step of ``dp_world`` ranks at batch ``b`` sees exactly
the samples a single rank sees at batch ``dp_world * b``, and rank ``r``'s batch
is exactly microbatch ``r`` of a single rank accumulating ``dp_world`` microbatches
of ``b``: changing only the parallelism does not change the data, and FSDP
against gradient accumulation can be compared bit for bit.
The state is the number of samples taken, so resuming is exact.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from titan_plugins.errors import ConfigError

Sample = tuple[torch.Tensor, torch.Tensor]


def _rng(*key: int) -> np.random.Generator:
    # SeedSequence wants non-negative ints; wrap negative seeds instead of failing.
    return np.random.default_rng([k & (2**64 - 1) for k in key])


class ShardedStream:
    """Base class: rank ``dp_rank`` takes block ``dp_rank`` of every ``dp_world`` blocks.

    Subclasses implement ``sample(index)`` (the run-wide sample ``index``) and
    may extend ``identity()`` with what must match for a saved state to apply.
    """

    def __init__(self, *, seq_len: int, dp_rank: int, dp_world: int, seed: int) -> None:
        if seq_len < 1:
            raise ConfigError(f"training.seq_len={seq_len} must be at least 1")
        if not 0 <= dp_rank < dp_world:
            raise ValueError(f"dp_rank={dp_rank} is not in [0, dp_world={dp_world})")
        self.seq_len, self.dp_rank, self.dp_world, self.seed = seq_len, dp_rank, dp_world, seed
        self.taken = 0  # samples this rank has yielded
        self.block = 1  # samples per rank per step; the loader sets its batch size

    def sample(self, index: int) -> Sample:
        raise NotImplementedError

    def identity(self) -> dict[str, Any]:
        return {"kind": type(self).__name__, "seq_len": self.seq_len}

    def __iter__(self) -> Iterator[Sample]:
        while True:  # reads self.taken each time, so load_state_dict applies at once
            rounds, within = divmod(self.taken, self.block)
            index = (rounds * self.dp_world + self.dp_rank) * self.block + within
            self.taken += 1
            yield self.sample(index)

    def state_dict(self) -> dict[str, Any]:
        # Run-wide count, so a resume at another dp degree continues where the run was.
        return {"samples": self.taken * self.dp_world, **self.identity()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key, value in self.identity().items():
            if state.get(key) != value:
                raise ConfigError(
                    f"the checkpoint's data state has {key}={state.get(key)!r} but this run has "
                    f"{value!r}: resume with the same data settings or start a new run"
                )
        self.taken = int(state["samples"]) // self.dp_world


class PackedTokenDataset(ShardedStream):
    """Windows of ``seq_len + 1`` tokens cut from one token array (documents
    joined with BOS/EOS), in an order reshuffled every epoch from the seed.

    Window ``i`` is ``tokens[i * seq_len : (i + 1) * seq_len + 1]``: neighbours
    share one token, so every token but the first is a label exactly once per epoch.
    """

    def __init__(
        self,
        tokens: np.ndarray,
        *,
        seq_len: int,
        dp_rank: int,
        dp_world: int,
        seed: int,
        shuffle: bool = True,
        source: str = "data.path",
    ) -> None:
        super().__init__(seq_len=seq_len, dp_rank=dp_rank, dp_world=dp_world, seed=seed)
        self.tokens = tokens
        self.num_windows = (len(tokens) - 1) // seq_len
        if self.num_windows < 1:
            raise ConfigError(
                f"{source} holds {len(tokens)} tokens, "
                f"fewer than training.seq_len + 1 = {seq_len + 1}"
            )
        self.shuffle = shuffle
        self._epoch, self._order = -1, np.arange(0)

    def identity(self) -> dict[str, Any]:
        return {**super().identity(), "num_tokens": len(self.tokens)}

    def window_index(self, index: int) -> int:
        """Which window the run-wide sample ``index`` is."""
        epoch, pos = divmod(index, self.num_windows)
        if not self.shuffle:
            return pos
        if epoch != self._epoch:  # ranks move through epochs together, so one cached order
            self._epoch, self._order = epoch, _rng(self.seed, epoch).permutation(self.num_windows)
        return int(self._order[pos])

    def sample(self, index: int) -> Sample:
        start = self.window_index(index) * self.seq_len
        window = torch.from_numpy(self.tokens[start : start + self.seq_len + 1].astype(np.int64))
        return window[:-1], window[1:]


class SyntheticTokenDataset(ShardedStream):
    """Uniform random tokens in ``[0, vocab_size)``; sample ``index`` is drawn
    from ``(seed, index)`` alone, so any rank and any resume reproduce it."""

    def __init__(
        self, vocab_size: int, *, seq_len: int, dp_rank: int, dp_world: int, seed: int
    ) -> None:
        super().__init__(seq_len=seq_len, dp_rank=dp_rank, dp_world=dp_world, seed=seed)
        if vocab_size < 1:
            raise ConfigError(f"synthetic data needs a vocab size >= 1, got {vocab_size}")
        self.vocab_size = vocab_size

    def identity(self) -> dict[str, Any]:
        return {**super().identity(), "vocab_size": self.vocab_size}

    def sample(self, index: int) -> Sample:
        window = _rng(self.seed, index).integers(0, self.vocab_size, self.seq_len + 1)
        window = torch.from_numpy(window.astype(np.int64))
        return window[:-1], window[1:]
