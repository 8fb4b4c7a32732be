"""Streaming sources: text, JSONL, Parquet and local Hugging Face datasets, read lazily.

A source is cut into *units* from metadata alone (byte ranges of text/JSONL
files, Parquet row groups, row ranges of a dataset), never by reading it. The
units are dealt to ``G`` streams, one per row of the global batch (``G`` =
data-parallel ranks x ``local_batch_size`` x ``grad_accum_steps``): stream ``s``
reads units ``s, s+G, ...`` in an order reshuffled every epoch from the seed,
tokenizes ``TOKENIZE_BATCH`` records at a time with ``tokenizers``'
``encode_batch`` (Rust), and packs the tokens into windows of ``seq_len + 1``
(neighbours share one token), documents joined by the tokenizer's BOS/EOS.
Row ``i`` of the run is window ``i // G`` of stream ``i % G`` (``RowStream``), so
the global batch is the same at any data-parallel degree and accumulation split,
and a rank reads only the streams of the rows it owns, never the whole corpus.

The state is where each stream is (epoch, unit, the record its current batch
starts at, the tokens carried into that batch, rows taken from it): a few
integers and fewer than ``seq_len`` tokens per stream; a resume re-reads that
one batch and continues bitwise. torchdata's ``StatefulDataLoader`` runs the
rank's rows in worker processes with prefetch and keeps each worker's state
with the batches it hands out (``StreamingLoader``). A resume at another
data-parallel degree or accumulation split is refused in one line.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from titan_plugins.errors import ConfigError

TOKENIZE_BATCH = 256  # records per encode_batch call
BLOCK_BYTES = 4 << 20  # the largest byte range of a text/JSONL file one unit covers
MIN_BLOCK_BYTES = 1 << 10  # small files still split into a stream per row of the global batch
SCAN_BYTES = 64 << 20  # up to this size a source's units are checked for line starts
HF_ROWS = 4096  # rows of a Hugging Face dataset per unit
TEXT_LINES = 64  # lines of a text file per record
SUFFIXES = {"text": (".txt",), "jsonl": (".jsonl",), "parquet": (".parquet",)}


@dataclass(frozen=True)
class Unit:
    """``records`` of one file: byte range (text/jsonl), row group (parquet), rows (hf)."""

    path: str
    start: int
    stop: int


def _rng(*key: int) -> np.random.Generator:
    return np.random.default_rng([k & (2**64 - 1) for k in key])


# ------------------------------------------------------------------ sources
def _files(cfg: Any, kind: str) -> list[Path]:
    from titan_plugins.train.data.sources import find_files

    return find_files(cfg.path, SUFFIXES[kind], kind)


def _open_hf(path: str, split: str) -> Any:
    os.environ["HF_DATASETS_OFFLINE"] = "1"  # read when `datasets` is first imported
    try:
        import datasets
    except ImportError:
        raise ConfigError(
            f"data.name=hf needs the 'datasets' package to read data.path={path!r} "
            "(pip install datasets)"
        ) from None
    p = Path(path).expanduser()
    try:
        if (p / "dataset_info.json").exists() or (p / "dataset_dict.json").exists():
            ds = datasets.load_from_disk(str(p))  # memory-mapped Arrow: nothing read yet
            if isinstance(ds, datasets.DatasetDict):
                if split not in ds:
                    raise ConfigError(f"data.split={split!r} is not in {list(ds)} at data.path={path!r}")
                ds = ds[split]
        elif p.is_file():
            builder = {"jsonl": "json", "txt": "text"}.get(p.suffix.lstrip("."), p.suffix.lstrip("."))
            ds = datasets.load_dataset(builder, data_files=str(p), split=split)
        else:
            ds = datasets.load_dataset(str(p), split=split)
    except ConfigError:
        raise
    except Exception as exc:  # datasets raises many types; the first line says enough
        first = (str(exc).strip() or type(exc).__name__).splitlines()[0]
        raise ConfigError(f"data.path={path!r} could not be loaded by datasets: {first}") from None
    return ds


def plan_units(cfg: Any, kind: str, n_shards: int) -> list[Unit]:
    """The source's units, from file sizes and metadata only."""
    if kind == "hf":
        if not cfg.path:
            raise ConfigError("data.name=hf needs data.path (a local dataset folder or file)")
        if not Path(cfg.path).expanduser().exists():
            raise ConfigError(f"data.path={cfg.path!r} does not exist (data.name=hf reads local paths only)")
        n = len(_open_hf(cfg.path, cfg.split))
        rows = max(1, min(HF_ROWS, -(-n // n_shards)))
        return [Unit(str(cfg.path), s, min(s + rows, n)) for s in range(0, n, rows)]
    files = _files(cfg, kind)
    if kind == "parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise ConfigError("data.name=parquet needs pyarrow (pip install 'titan-plugins[parquet]')") from None
        units = []
        for f in files:
            try:
                groups = pq.ParquetFile(f).metadata.num_row_groups
            except Exception as exc:
                raise ConfigError(f"data.path: {f} is not a Parquet file ({exc})") from None
            units += [Unit(str(f), g, g + 1) for g in range(groups)]
        return units
    total = sum(f.stat().st_size for f in files)
    block = max(MIN_BLOCK_BYTES, min(BLOCK_BYTES, -(-total // (4 * n_shards))))
    units = [
        Unit(str(f), s, min(s + block, size))
        for f in files
        for size in [f.stat().st_size]
        for s in range(0, size, block)
    ]
    if total <= SCAN_BYTES:  # small: drop ranges where no line starts (inside a long line)
        units = [u for u in units if _starts_a_line(u)]
    return units


def _starts_a_line(unit: Unit) -> bool:
    """Whether a line starts in the unit's byte range (a record of it, in ``_lines``)."""
    if unit.start == 0:
        return True
    with open(unit.path, "rb") as f:
        f.seek(unit.start - 1)
        return b"\n" in f.read(unit.stop - unit.start)


def _lines(unit: Unit) -> Iterator[tuple[int, bytes]]:
    """(line number within the unit, line) for the lines that start in the unit's range."""
    with open(unit.path, "rb") as f:
        if unit.start > 0:
            f.seek(unit.start - 1)
            if f.read(1) != b"\n":
                f.readline()  # the line that began before this unit is the previous unit's
        k = 0
        while f.tell() < unit.stop:
            line = f.readline()
            if not line:
                break
            yield k, line
            k += 1


def _decode(line: bytes, unit: Unit) -> str:
    try:
        return line.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"data.path: {unit.path} is not UTF-8 text (byte {exc.start} of a line near offset {unit.start})"
        ) from None


def read_records(kind: str, unit: Unit, cfg: Any, hf_ds: Any = None) -> Iterator[tuple[str, bool, bool]]:
    """The unit's records as ``(text, starts_document, ends_document)``."""
    field = cfg.text_field
    if kind == "text":  # a file is one document; records are groups of lines
        size = os.path.getsize(unit.path)
        group: list[str] = []
        first = unit.start == 0
        for _, line in _lines(unit):
            group.append(_decode(line, unit))
            if len(group) == TEXT_LINES:
                yield "".join(group), first, False
                group, first = [], False
        if group or first or unit.stop >= size:
            yield "".join(group), first, unit.stop >= size
    elif kind == "jsonl":
        for k, line in _lines(unit):
            if not line.strip():
                continue
            try:
                record = json.loads(_decode(line, unit))
            except ValueError as exc:
                raise ConfigError(f"data.path: {unit.path} (line {k + 1} of its block at byte {unit.start}) "
                                  f"is not valid JSON ({exc})") from None
            if not isinstance(record, dict) or field not in record:
                where = f"{unit.path}:{k + 1}" if unit.start == 0 else f"{unit.path} (near byte {unit.start})"
                raise ConfigError(f"data.text_field={field!r} is not a key of {where}")
            yield str(record[field]), True, True
    elif kind == "parquet":
        import pyarrow.parquet as pq

        table = pq.ParquetFile(unit.path).read_row_group(unit.start, columns=[field])
        for text in table.column(0).to_pylist():
            yield str(text), True, True
    else:  # hf
        for text in hf_ds[unit.start : unit.stop][field]:
            yield str(text), True, True


def check_data_source(data_cfg: Any) -> None:
    """Read a few bytes/rows of every file source of ``data_cfg`` (of each ``data.mix``
    entry for ``data.name=mix``, whose names and weights are checked first); a
    ConfigError in one line for a missing or empty file, a glob matching nothing, a
    missing text field, a file that is not UTF-8, a bad mix entry. Cheap: the
    launcher runs it before any rank starts (``DatasetSpec.check``, ``train/prelaunch.py``)."""
    if _get(data_cfg, "name") == "chat_sample":
        from titan_plugins.train.data.chat_source import check_chat_source, sample_config

        return check_chat_source(sample_config(data_cfg))
    if _get(data_cfg, "name") == "mix":
        configs = [cfg for cfg, _ in mix_entries(data_cfg)]
    else:
        configs = [_entry_config(data_cfg, data_cfg)]
    for cfg in configs:
        kind = cfg.name
        if kind == "chat":
            from titan_plugins.train.data.chat_source import check_chat_source

            check_chat_source(_chat_entry(data_cfg, cfg))
            continue
        if kind not in SUFFIXES and kind != "hf":
            continue
        if kind != "hf":
            files = _files(cfg, kind)
            for f in files:
                if f.stat().st_size == 0:
                    raise ConfigError(f"data.path: {f} is empty")
            if kind != "parquet":
                for f in files:
                    head = Path(f).open("rb").read(1 << 16)
                    try:
                        head.decode("utf-8")
                    except UnicodeDecodeError as exc:
                        if exc.start < len(head) - 4:  # not a character cut at the end
                            raise ConfigError(f"data.path: {f} is not UTF-8 text (byte {exc.start})") from None
        units = plan_units(cfg, kind, 1)
        if not units:
            raise ConfigError(f"data.path={cfg.path!r} holds no rows")
        hf_ds = _open_hf(cfg.path, cfg.split) if kind == "hf" else None
        if hf_ds is not None and cfg.text_field not in hf_ds.column_names:
            raise ConfigError(f"data.text_field={cfg.text_field!r} is not a column of {hf_ds.column_names}")
        if kind == "parquet":
            import pyarrow.parquet as pq

            names = pq.ParquetFile(units[0].path).schema_arrow.names
            if cfg.text_field not in names:
                raise ConfigError(f"data.text_field={cfg.text_field!r} is not a column of {units[0].path} ({names})")
        for _, _record in zip(range(4), read_records(kind, units[0], cfg, hf_ds)):
            pass


# ------------------------------------------------------------------ dataset
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


def _fresh() -> dict[str, Any]:
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
        self.cfg = _plain(cfg)
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
            self._hf = _open_hf(self.cfg.path, self.cfg.split)
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
        return _fresh()

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
            order = _rng(self.seed, st["epoch"], s).permutation(len(mine))
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
            if not yielded_in_epoch:
                raise ConfigError(
                    f"{self.source} holds {tokens_in_epoch} tokens, fewer than training.seq_len + 1 = "
                    f"{self.seq_len + 1} (in loader stream {s} of {self.n_streams}, one per row of the "
                    "global batch where the source allows)"
                )
            st["epoch"] += 1
            st["unit"] = 0


class MixedDataset(RowStream):
    """``data.mix``: row ``i`` comes from the source drawn by weight from
    ``(seed, i)``, as the next window of that source's stream ``i % G``; so the mix,
    like each source, is the same at any parallel layout."""

    CHUNK = 4096

    def __init__(self, parts: list[StreamingTokenDataset], weights: list[float], seed: int) -> None:
        first = parts[0]
        super().__init__(dp_rank=first.dp_rank, dp_world=first.dp_world,
                         num_workers=first.num_workers, seq_len=first.seq_len)
        self.parts, self.seed = parts, seed
        total = float(sum(weights))
        self.p = np.asarray(weights, dtype=np.float64) / total
        self.scan: dict[int, int] = {}  # per stream: the next row of it not yet drawn
        self._chunk: tuple[int, np.ndarray] = (-1, np.zeros(0))

    def set_layout(self, local_batch_size: int, grad_accum_steps: int) -> None:
        super().set_layout(local_batch_size, grad_accum_steps)
        for part in self.parts:
            part.set_layout(local_batch_size, grad_accum_steps)

    def identity(self) -> dict[str, Any]:
        return {"mix": [p.identity() for p in self.parts], "weights": self.p.round(12).tolist()}

    def state_dict(self) -> dict[str, Any]:
        return {"taken": self.taken, "scan": {str(k): v for k, v in self.scan.items()},
                "parts": [p.state_dict() for p in self.parts], **self.identity()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        check_identity(state, self.identity())
        self.taken = int(state["taken"])
        self.scan = {int(k): int(v) for k, v in state["scan"].items()}
        for part, s in zip(self.parts, state["parts"]):
            part.load_state_dict(s)

    def choice(self, index: int) -> int:
        chunk, pos = divmod(index, self.CHUNK)
        if self._chunk[0] != chunk:
            self._chunk = (chunk, _rng(self.seed, chunk).choice(len(self.p), self.CHUNK, p=self.p))
        return int(self._chunk[1][pos])

    def row(self, index: int) -> Any:
        g = self.global_rows
        s = index % g
        j = self.scan.get(s, s)
        while j < index:  # rows of this stream another worker owns: their windows go by
            self.parts[self.choice(j)].take(s)
            j += g
        self.scan[s] = index + g
        part = self.parts[self.choice(index)]
        sample = part.take(s)
        if len(sample) == 2 and any(getattr(p, "chat", {}).get("pack") for p in self.parts):
            # Rows of packed conversations carry document ids: give a text row its own
            # (from its EOS tokens), so the batch has them for every row.
            from titan_plugins.components.attention_masks import document_ids

            docs = document_ids(sample[0][None], part.tokenizer.eos_id)[0].long()
            sample = (*sample, docs)
        return sample


def check_identity(state: Mapping[str, Any], identity: Mapping[str, Any]) -> None:
    for key, value in identity.items():
        if state.get(key) != value:
            raise ConfigError(
                f"the checkpoint's data state has {key}={state.get(key)!r} but this run has "
                f"{value!r}: resume with the same data settings (and data.num_workers, data-parallel "
                "degree) or start a new run"
            )


# ------------------------------------------------------------------ loader
class StreamingLoader:
    """``(input_ids, labels)`` batches from a StatefulDataLoader over ``dataset``;
    ``state_dict``/``load_state_dict`` hold every worker's exact position."""

    def __init__(self, dataset: Any, *, local_batch_size: int, seq_len: int, num_workers: int,
                 prefetch_factor: int, name: str = "") -> None:
        self.dataset, self.local_batch_size, self.seq_len, self.name = dataset, local_batch_size, seq_len, name
        self.num_workers, self.prefetch_factor = num_workers, prefetch_factor
        if num_workers > 0:
            os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # one thread per worker
        self._loader = self._make()
        self._it: Iterator[Any] | None = None

    def _make(self) -> Any:
        from torchdata.stateful_dataloader import StatefulDataLoader

        extra = {"prefetch_factor": self.prefetch_factor} if self.num_workers > 0 else {}
        with warnings.catch_warnings():  # torchdata 0.11 calls a deprecated torch.set_vital
            warnings.filterwarnings("ignore", message=".*set_vital.*")
            return StatefulDataLoader(self.dataset, batch_size=self.local_batch_size,
                                      num_workers=self.num_workers, **extra)

    def __iter__(self) -> StreamingLoader:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._it is None:
            self._it = iter(self._loader)
        try:
            batch = next(self._it)
        except Exception as exc:  # a worker's ConfigError comes back wrapped: one line
            text = str(exc)
            if "ConfigError" in text or isinstance(exc, ConfigError):
                line = [ln for ln in text.splitlines() if ln.strip()][-1]
                raise ConfigError(line.split("ConfigError: ", 1)[-1]) from None
            raise
        from titan_plugins.train.data.loader import Batch

        return Batch(*(t.long() for t in batch))

    def stats(self) -> dict[str, int]:
        """Counts the source keeps (a chat source: conversations truncated, dropped, skipped),
        summed over this rank's workers as of the last batch handed out."""
        return _sum_stats(self._loader.state_dict())

    @property
    def _key(self) -> str:
        parts = getattr(self.dataset, "parts", None) or [self.dataset]
        return f"dp_rank{parts[0].dp_rank}"

    def state_dict(self) -> dict[str, Any]:
        # Ranks differ, so the key names the data-parallel rank (torch.distributed.checkpoint
        # keeps one value per key), and the value is one JSON string: the loader's state
        # has a shape that a fresh loader's template does not know yet.
        state = {"stream": self._loader.state_dict(), "identity": self.dataset.identity(),
                 "num_workers": self.num_workers}
        return {self._key: json.dumps(state)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if self._key not in state:
            raise ConfigError(f"the checkpoint's data state has no {self._key} "
                              "(saved at another data-parallel degree): resume with the same one")
        state = json.loads(state[self._key])
        check_identity(state["identity"], self.dataset.identity())
        if int(state.get("num_workers", -1)) != self.num_workers:
            raise ConfigError(f"the checkpoint's data state has data.num_workers={state.get('num_workers')} "
                              f"but this run has {self.num_workers}: resume with the same value")
        self._loader = self._make()
        self._loader.load_state_dict(state["stream"])
        self._it = None


def _sum_stats(state: Any) -> dict[str, int]:
    """Every ``"stats"`` (and ``"pending"``: the batch being handed out) mapping found in a
    (nested) loader state, summed."""
    total: dict[str, int] = {}
    if isinstance(state, Mapping):
        for key, value in state.items():
            if key in ("stats", "pending") and isinstance(value, Mapping):
                for k, v in value.items():
                    total[k] = total.get(k, 0) + int(v)
            else:
                for k, v in _sum_stats(value).items():
                    total[k] = total.get(k, 0) + v
    elif isinstance(state, (list, tuple)):
        for value in state:
            for k, v in _sum_stats(value).items():
                total[k] = total.get(k, 0) + v
    return total


def _plain(cfg: Any) -> Any:
    """A picklable copy of the config fields a source reads."""
    from types import SimpleNamespace

    return SimpleNamespace(name=_get(cfg, "name"), path=_get(cfg, "path"),
                           text_field=_get(cfg, "text_field", "text"), split=_get(cfg, "split", "train"))


def _get(cfg: Any, key: str, default: Any = None) -> Any:
    value = cfg.get(key, default) if isinstance(cfg, Mapping) or hasattr(cfg, "get") else getattr(cfg, key, default)
    return default if value is None and default is not None else value


def _entry_config(base: Any, entry: Any) -> Any:
    """A ``data.mix`` entry with the base data settings as defaults."""
    if entry is base:
        return _plain(base)
    from types import SimpleNamespace

    merged = {k: _get(base, k) for k in ("name", "path", "text_field", "split")}
    merged.update({k: _get(entry, k) for k in ("name", "path", "text_field", "split") if _get(entry, k) is not None})
    return _plain(SimpleNamespace(**merged))


def _chat_entry(base: Any, cfg: Any, workers: int = 0) -> Any:
    """A chat source's config: the entry's path and split with the base's ``chat`` and tokenizer."""
    from types import SimpleNamespace

    return SimpleNamespace(name="chat", path=cfg.path, split=cfg.split, chat=_get(base, "chat"),
                           tokenizer=_get(base, "tokenizer"), num_workers=workers)


def build_streaming(data_config: Any, tokenizer: Any, kind: str, *, dp_rank: int, dp_world: int,
                    seq_len: int, seed: int) -> StreamingTokenDataset:
    check_data_source(_plain(data_config))
    return StreamingTokenDataset(
        data_config, kind, tokenizer, dp_rank=dp_rank, dp_world=dp_world,
        num_workers=int(_get(data_config, "num_workers", 0) or 0), seq_len=seq_len, seed=seed,
    )


def build_mix(data_config: Any, tokenizer: Any, *, dp_rank: int, dp_world: int, seq_len: int,
              seed: int) -> MixedDataset:
    """``data.mix=[{name, path, weight, text_field?, split?}, ...]`` of streaming sources."""
    workers = int(_get(data_config, "num_workers", 0) or 0)
    parts, weights = [], []
    for i, (cfg, weight) in enumerate(mix_entries(data_config)):
        if cfg.name == "chat":
            from titan_plugins.train.data.chat_source import build_chat

            parts.append(build_chat(_chat_entry(data_config, cfg, workers), tokenizer, dp_rank=dp_rank,
                                    dp_world=dp_world, seq_len=seq_len, seed=seed + i))
            weights.append(weight)
            continue
        check_data_source(cfg)
        parts.append(StreamingTokenDataset(cfg, cfg.name, tokenizer, dp_rank=dp_rank, dp_world=dp_world,
                                           num_workers=workers, seq_len=seq_len, seed=seed + i))
        weights.append(weight)
    return MixedDataset(parts, weights, seed)


def mix_entries(data_config: Any) -> list[tuple[Any, float]]:
    """``(source config, weight)`` of each ``data.mix`` entry; a ConfigError in one line
    for an empty mix, a source that cannot be mixed, or a weight that is not positive."""
    entries = list(_get(data_config, "mix") or [])
    if not entries:
        raise ConfigError("data.name=mix needs data.mix (a list of {name, path, weight})")
    out = []
    for i, entry in enumerate(entries):
        cfg = _entry_config(data_config, entry)
        if cfg.name not in SUFFIXES and cfg.name not in ("hf", "chat"):
            raise ConfigError(f"data.mix[{i}].name={cfg.name!r} must be one of text, jsonl, parquet, hf, chat")
        weight = _get(entry, "weight", 1.0)
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not weight > 0:
            raise ConfigError(f"data.mix[{i}].weight={weight!r} must be a positive number")
        out.append((cfg, float(weight)))
    return out
