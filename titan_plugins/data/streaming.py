"""Streaming sources packed into windows, one stream per row of the global batch.

The units of a source (``units.py``) are dealt to ``G`` streams, one per row of the
global batch (``G`` = data-parallel ranks x ``local_batch_size`` x
``grad_accum_steps``): stream ``s`` reads units ``s, s+G, ...`` in an order
reshuffled every epoch from the seed, tokenizes ``TOKENIZE_BATCH`` records at a time
with ``tokenizers``' ``encode_batch`` (Rust), and packs the tokens into windows of
``seq_len + 1`` (neighbours share one token), documents joined by the tokenizer's
BOS/EOS. Row ``i`` of the run is window ``i // G`` of stream ``i % G`` (``RowStream``),
and a rank reads only the streams of the rows it owns, never the whole corpus.

The state is where each stream is (epoch, unit, the record its current batch
starts at, the tokens carried into that batch, rows taken from it): a few
integers and fewer than ``seq_len`` tokens per stream; a resume re-reads that
one batch and continues bitwise.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import torch

from titan_plugins.data.rows import RowStream, check_identity, seeded_rng
from titan_plugins.data.units import (
    Unit,
    cfg_get,
    check_source,
    open_hf,
    plain_config,
    plan_units,
    read_records,
)
from titan_plugins.errors import ConfigError

TOKENIZE_BATCH = 256  # records per encode_batch call


def fresh_stream_state() -> dict[str, Any]:
    """A stream's state before its first window."""
    return {"epoch": 0, "unit": 0, "record": 0, "carry": [], "rows": 0, "windows": 0}


class StreamingTokenDataset(RowStream):
    """Packed ``(input_ids, labels)`` windows of one streaming source.

    The source's units are dealt to ``G`` streams (one per row of the global batch:
    stream ``s`` reads units ``s, s+G, ...``); row ``i`` is window ``i // G`` of
    stream ``i % G``. A rank reads only the streams of the rows it owns, so no rank
    reads the whole corpus, and the global batch is the same at any data-parallel
    degree and accumulation split. Each stream's state is a few integers and fewer
    than ``seq_len`` tokens (a resume re-reads one tokenize batch)."""

    BATCH = TOKENIZE_BATCH  # records read and tokenized at a time

    def __init__(self, cfg: Any, kind: str, tokenizer: Any, *, dp_rank: int, dp_world: int,
                 num_workers: int, seq_len: int, seed: int) -> None:
        super().__init__(dp_rank=dp_rank, dp_world=dp_world, num_workers=num_workers, seq_len=seq_len)
        self.cfg = plain_config(cfg)
        self.kind, self.tokenizer, self.seed = kind, tokenizer, seed
        self.source = f"data.path={self.cfg.path!r}"
        self._hf = None
        self.units: list[Unit] = []
        self.states: dict[int, dict[str, Any]] = {}
        self._gens: dict[int, Iterator[Any]] = {}
        self.set_layout(1, 1)

    def set_layout(self, local_batch_size: int, grad_accum_steps: int) -> None:
        super().set_layout(local_batch_size, grad_accum_steps)
        self.units = plan_units(self.cfg, self.kind, self.global_rows)
        # One stream per unit where the source is too small for one per row: still the
        # same rows at any layout; ranks then read streams they share (a small source).
        self.n_streams = max(1, min(self.global_rows, len(self.units)))

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_hf": None, "_gens": {}}  # workers reopen the dataset

    def identity(self) -> dict[str, Any]:
        return {"kind": self.kind, **super().identity(), "units": len(self.units)}

    def state_dict(self) -> dict[str, Any]:
        streams = {str(s): {**st, "carry": list(st["carry"])} for s, st in self.states.items()}
        return {"taken": self.taken, "streams": streams, **self.identity()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        check_identity(state, self.identity())
        self.taken = int(state["taken"])
        self.states = {int(s): self._load_stream(st) for s, st in state["streams"].items()}
        self._gens = {}

    def _load_stream(self, st: Mapping[str, Any]) -> dict[str, Any]:
        return {k: (list(v) if isinstance(v, list) else v) for k, v in st.items()}

    # ---------------------------------------------------------------- rows
    def row(self, index: int) -> Any:
        s, k = index % self.n_streams, index // self.n_streams
        st = self.states.setdefault(s, self._fresh())
        while st["windows"] < k:  # rows of this stream that another worker owns
            self.take(s)
        return self.take(s)

    def take(self, s: int) -> Any:
        """Stream ``s``'s next window."""
        st = self.states.setdefault(s, self._fresh())
        if s not in self._gens:
            self._gens[s] = self._stream(s, st)
        sample = next(self._gens[s])
        st["windows"] += 1
        return sample

    def _records(self, unit: Unit) -> Iterator[Any]:
        if self.kind == "hf" and self._hf is None:
            self._hf = open_hf(self.cfg.path, self.cfg.split)
        return read_records(self.kind, unit, self.cfg, self._hf)

    def _tokens(self, batch: list[tuple[str, bool, bool]]) -> list[int]:
        bos, eos = self.tokenizer.bos_id, self.tokenizer.eos_id
        out: list[int] = []
        for (_, first, last), ids in zip(batch, self.tokenizer.encode_batch([b[0] for b in batch])):
            if first and bos >= 0:
                out.append(bos)
            out.extend(ids)
            if last and eos >= 0:
                out.append(eos)
        return out

    def _fresh(self) -> dict[str, Any]:
        return fresh_stream_state()

    def _flush(self, st: dict[str, Any]) -> list[Any]:
        """Rows from what ``st`` carries when a whole epoch made none (the source is
        smaller than one row); the carry is emptied first, so a resume after them starts
        the next epoch. Text is not padded: none (the caller refuses the source)."""
        return []

    def _pack(self, st: dict[str, Any], batch: list[Any]) -> tuple[list[Any], dict[str, Any], int]:
        """The rows that ``batch`` completes after ``st["carry"]``, the state after them
        (the new carry; what subclasses count), and the tokens ``batch`` held."""
        n = self.seq_len
        tokens = self._tokens(batch)
        buf = np.asarray(st["carry"] + tokens, dtype=np.int64)
        rows = max(0, (len(buf) - 1) // n)
        out = []
        for r in range(rows):
            window = torch.from_numpy(buf[r * n : (r + 1) * n + 1].copy())
            out.append((window[:-1], window[1:]))
        return out, {"carry": buf[rows * n :].tolist()}, len(tokens)

    def _stream(self, s: int, st: dict[str, Any]) -> Iterator[Any]:
        mine = self.units[s :: self.n_streams]
        while True:
            order = seeded_rng(self.seed, st["epoch"], s).permutation(len(mine))
            yielded_in_epoch = st["unit"] > 0 or st["record"] > 0 or st["rows"] > 0
            tokens_in_epoch = 0
            while st["unit"] < len(mine):
                records = self._records(mine[order[st["unit"]]])
                for _ in range(st["record"]):
                    next(records, None)
                while True:
                    batch = [r for _, r in zip(range(self.BATCH), records)]
                    if not batch:
                        break
                    rows, after, size = self._pack(st, batch)
                    tokens_in_epoch += size
                    for r in range(st["rows"], len(rows)):
                        st["rows"] = r + 1
                        yielded_in_epoch = True
                        yield rows[r]
                    st["record"] += len(batch)
                    st.update(after)
                    st["rows"] = 0
                st["unit"] += 1
                st["record"] = 0
            if not yielded_in_epoch:  # a source smaller than one row: what a subclass pads
                for row in self._flush(st):
                    yielded_in_epoch = True
                    yield row
            if not yielded_in_epoch:
                raise ConfigError(
                    f"{self.source} holds {tokens_in_epoch} tokens, fewer than training.seq_len + 1 = "
                    f"{self.seq_len + 1} (in loader stream {s} of {self.n_streams}, one per row of the "
                    "global batch where the source allows)"
                )
            st["epoch"] += 1
            st["unit"] = 0


def build_streaming(data_config: Any, tokenizer: Any, kind: str, *, dp_rank: int, dp_world: int,
                    seq_len: int, seed: int) -> StreamingTokenDataset:
    """The builder of text/jsonl/parquet/hf (``kind``): checked, then streamed."""
    check_source(plain_config(data_config))
    return StreamingTokenDataset(
        data_config, kind, tokenizer, dp_rank=dp_rank, dp_world=dp_world,
        num_workers=int(cfg_get(data_config, "num_workers", 0) or 0), seq_len=seq_len, seed=seed,
    )
