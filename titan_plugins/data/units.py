"""A streaming source cut into units, and the records of a unit.

A source is cut into *units* from metadata alone (byte ranges of text/JSONL
files, Parquet row groups, row ranges of a dataset), never by reading it;
``read_records`` yields one unit's records. ``check_source`` reads a few of them
before launch. The bottom of the streaming data modules: it imports none of them.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from titan_plugins.errors import ConfigError

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


def find_files(path: str | None, suffixes: tuple[str, ...], name: str, key: str = "data.path") -> list[Path]:
    """``path`` itself if it is a file, else the files under it ending in ``suffixes``;
    errors name ``key`` (the setting or argument that gave the path)."""
    if not path:
        raise ConfigError(f"data.name={name} needs {key} (a file or a directory)")
    p = Path(path).expanduser()
    if not p.exists():
        raise ConfigError(f"{key}={path!r} does not exist")
    if p.is_file():
        return [p]
    files = sorted(f for f in p.rglob("*") if f.is_file() and f.name.endswith(suffixes))
    if not files:
        raise ConfigError(f"{key}={path!r} holds no {'/'.join(suffixes)} files")
    return files


def source_files(cfg: Any, kind: str) -> list[Path]:
    return find_files(cfg.path, SUFFIXES[kind], kind)


def import_datasets(path: str) -> Any:
    """The ``datasets`` module, offline (never a download), or one line saying it is missing."""
    os.environ["HF_DATASETS_OFFLINE"] = "1"  # read when `datasets` is first imported
    try:
        import datasets
    except ImportError:
        raise ConfigError(
            f"data.name=hf needs the 'datasets' package to read data.path={path!r} "
            "(pip install datasets)"
        ) from None
    return datasets


def open_hf(path: str, split: str) -> Any:
    """A local Hugging Face dataset (a ``save_to_disk`` folder, a folder of data files, or one
    data file) as a ``datasets.Dataset`` of ``split``; every failure is one line."""
    datasets = import_datasets(path)
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
        n = len(open_hf(cfg.path, cfg.split))
        rows = max(1, min(HF_ROWS, -(-n // n_shards)))
        return [Unit(str(cfg.path), s, min(s + rows, n)) for s in range(0, n, rows)]
    files = source_files(cfg, kind)
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
        units = [u for u in units if starts_a_line(u)]
    return units


def starts_a_line(unit: Unit) -> bool:
    """Whether a line starts in the unit's byte range (a record of it, in ``unit_lines``)."""
    if unit.start == 0:
        return True
    with open(unit.path, "rb") as f:
        f.seek(unit.start - 1)
        return b"\n" in f.read(unit.stop - unit.start)


def unit_lines(unit: Unit) -> Iterator[tuple[int, bytes]]:
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


def decode_line(line: bytes, unit: Unit) -> str:
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
        for _, line in unit_lines(unit):
            group.append(decode_line(line, unit))
            if len(group) == TEXT_LINES:
                yield "".join(group), first, False
                group, first = [], False
        if group or first or unit.stop >= size:
            yield "".join(group), first, unit.stop >= size
    elif kind == "jsonl":
        for k, line in unit_lines(unit):
            if not line.strip():
                continue
            try:
                record = json.loads(decode_line(line, unit))
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


def check_source(cfg: Any) -> None:
    """Read a few bytes/rows of one text/jsonl/parquet/hf source (``cfg.name``; other
    names are not this module's and pass); a ConfigError in one line for a missing or
    empty file, a glob matching nothing, a missing text field, a file that is not UTF-8."""
    kind = cfg.name
    if kind not in SUFFIXES and kind != "hf":
        return
    if kind != "hf":
        files = source_files(cfg, kind)
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
    hf_ds = open_hf(cfg.path, cfg.split) if kind == "hf" else None
    if hf_ds is not None and cfg.text_field not in hf_ds.column_names:
        raise ConfigError(f"data.text_field={cfg.text_field!r} is not a column of {hf_ds.column_names}")
    if kind == "parquet":
        import pyarrow.parquet as pq

        names = pq.ParquetFile(units[0].path).schema_arrow.names
        if cfg.text_field not in names:
            raise ConfigError(f"data.text_field={cfg.text_field!r} is not a column of {units[0].path} ({names})")
    for _, _record in zip(range(4), read_records(kind, units[0], cfg, hf_ds)):
        pass


# ------------------------------------------------------------------ settings
def plain_config(cfg: Any) -> Any:
    """A picklable copy of the config fields a source reads."""
    from types import SimpleNamespace

    return SimpleNamespace(name=cfg_get(cfg, "name"), path=cfg_get(cfg, "path"),
                           text_field=cfg_get(cfg, "text_field", "text"), split=cfg_get(cfg, "split", "train"))


def cfg_get(cfg: Any, key: str, default: Any = None) -> Any:
    value = cfg.get(key, default) if isinstance(cfg, Mapping) or hasattr(cfg, "get") else getattr(cfg, key, default)
    return default if value is None and default is not None else value


def record_file_kind(path: str | None, source: str) -> str:
    """How ``data.path`` of a record source (``data.name=source``: chat, preference) is read:
    ``hf`` for a ``save_to_disk`` folder, else ``parquet`` or ``jsonl`` by the files."""
    if not path:
        raise ConfigError(f"data.name={source} needs data.path (a .jsonl/.parquet file, a folder of "
                          "them, or a Hugging Face save_to_disk folder)")
    p = Path(path).expanduser()
    if not p.exists():
        raise ConfigError(f"data.path={path!r} does not exist")
    if p.is_dir():
        if any((p / f).exists() for f in ("dataset_info.json", "dataset_dict.json", "state.json")):
            return "hf"
        if any(p.rglob("*.jsonl")):
            return "jsonl"
        if any(p.rglob("*.parquet")):
            return "parquet"
        raise ConfigError(f"data.path={path!r} holds no .jsonl or .parquet files and is no "
                          "Hugging Face save_to_disk folder")
    if p.suffix == ".parquet":
        return "parquet"
    if p.suffix in (".jsonl", ".json"):
        return "jsonl"
    raise ConfigError(f"data.path={path!r}: data.name={source} reads .jsonl, .parquet or a "
                      "save_to_disk folder")
