"""Where tokens come from: the shipped corpus, local text/JSONL files, local
Hugging Face datasets, or random tokens; and the dataset builders that
``builtin.py`` registers.

Every builder has the signature the loader calls::

    build(data_config, tokenizer, *, dp_rank, dp_world, seq_len, seed) -> ShardedStream

Text is tokenized once and the token array cached under the user cache dir
(``$TITAN_PLUGINS_CACHE``, else ``$XDG_CACHE_HOME/titan_plugins``), keyed by the
files' size and mtime and the tokenizer, so later runs (and other ranks) skip it.
The shipped corpus comes pre-tokenized, so the default run tokenizes nothing.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np

from titan_plugins.data.packing import PackedTokenDataset, SyntheticTokenDataset
from titan_plugins.data.tokenizer import ASSETS, Tokenizer

# find_files lived here before; the tokenizer trainer and users import it from here
from titan_plugins.data.units import find_files as find_files
from titan_plugins.data.units import import_datasets, open_hf
from titan_plugins.errors import ConfigError

CORPUS = ASSETS / "corpus.jsonl"
CORPUS_TOKENS = ASSETS / "corpus_tokens.npz"  # the corpus encoded with the shipped tokenizer


# ------------------------------------------------------------------- tokens
def encode_documents(docs: Iterable[str], tokenizer: Tokenizer) -> np.ndarray:
    """Concatenate ``BOS doc EOS`` for every document into one token array."""
    ids: list[int] = []
    bos = [tokenizer.bos_id] if tokenizer.bos_id >= 0 else []
    eos = [tokenizer.eos_id] if tokenizer.eos_id >= 0 else []
    for doc in tokenizer.encode_batch(list(docs)):  # in Rust, in parallel
        ids.extend(bos)
        ids.extend(doc)
        ids.extend(eos)
    return np.asarray(ids, dtype=np.uint16 if tokenizer.vocab_size <= 2**16 else np.int32)


def save_tokens(path: Path, tokens: np.ndarray, key: str) -> None:
    np.savez_compressed(path, tokens=tokens, key=np.array(key))


def corpus_key(tokenizer: Tokenizer) -> str:
    digest = hashlib.sha256(CORPUS.read_bytes())
    digest.update(tokenizer.fingerprint.encode())
    return digest.hexdigest()[:16]


def cache_dir() -> Path:
    root = os.environ.get("TITAN_PLUGINS_CACHE")
    if root:
        return Path(root)
    xdg = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(xdg) / "titan_plugins"


def cached_tokens(key: str, docs: Callable[[], Iterable[str]], tokenizer: Tokenizer) -> np.ndarray:
    """The encoded ``docs()``, from the cache when ``key`` was encoded before."""
    name = hashlib.sha256(f"{key}|{tokenizer.fingerprint}".encode()).hexdigest()[:24]
    path = cache_dir() / "tokens" / f"{name}.npy"
    if path.exists():
        return np.load(path)
    tokens = encode_documents(docs(), tokenizer)
    try:  # write then rename: ranks encoding at once never see half a file
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path.parent, suffix=".npy", delete=False) as f:
            np.save(f, tokens)
        os.replace(f.name, path)
    except OSError:
        pass  # an unwritable cache only costs time
    return tokens


def corpus_tokens(tokenizer: Tokenizer) -> np.ndarray:
    """The shipped corpus as tokens: pre-encoded for the shipped tokenizer."""
    key = corpus_key(tokenizer)
    with np.load(CORPUS_TOKENS) as shipped:
        if str(shipped["key"]) == key:
            return shipped["tokens"]
    return cached_tokens(f"corpus:{key}", lambda: read_jsonl(CORPUS, "text"), tokenizer)


HELD_OUT_FRACTION = 0.05  # of the builtin corpus's tokens: its validation split


def builtin_split(tokens: np.ndarray, split: str) -> np.ndarray:
    """``train``: all but the last 5% of the tokens; ``validation``: that last 5%."""
    cut = len(tokens) - int(len(tokens) * HELD_OUT_FRACTION)
    if split == "train":
        return tokens[:cut]
    if split == "validation":
        return tokens[cut:]
    raise ConfigError(f"data.split={split!r}: the builtin corpus has the splits 'train' and 'validation'")


# ------------------------------------------------------------------- files
def _files_key(files: list[Path], *extra: str) -> str:
    stats = [(str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns) for f in files]
    return json.dumps([stats, *extra])


def read_text(files: list[Path]) -> list[str]:
    """One document per file."""
    return [f.read_text(encoding="utf-8", errors="replace") for f in files]


def read_jsonl(path: str | Path, text_field: str) -> list[str]:
    """The ``text_field`` of every line of a JSONL file (or of a list of them)."""
    docs: list[str] = []
    for f in [Path(path)] if isinstance(path, (str, Path)) else path:
        with open(f, encoding="utf-8") as lines:
            for lineno, line in enumerate(lines, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except ValueError as exc:
                    raise ConfigError(
                        f"data.path: {f}:{lineno} is not valid JSON ({exc})"
                    ) from None
                if not isinstance(record, dict) or text_field not in record:
                    raise ConfigError(
                        f"data.text_field={text_field!r} is not a key of {f}:{lineno}"
                    )
                docs.append(str(record[text_field]))
    return docs


def hf_documents(
    path: str | None, split: str, text_field: str
) -> tuple[str, Callable[[], list[str]]]:
    """A cache key and a loader for the documents of a local Hugging Face dataset
    (a ``save_to_disk`` folder, a folder of data files, or one data file).
    Never downloads; the loader runs only when the cache misses."""
    if not path:
        raise ConfigError("data.name=hf needs data.path (a local dataset folder or file)")
    p = Path(path).expanduser()
    if not p.exists():
        raise ConfigError(
            f"data.path={path!r} does not exist (data.name=hf reads local paths only)"
        )
    import_datasets(path)  # a missing package is one line now, not when the cache misses

    def load() -> list[str]:
        ds = open_hf(path, split)
        if text_field not in ds.column_names:
            raise ConfigError(
                f"data.text_field={text_field!r} is not a column of {ds.column_names}"
            )
        return [str(text) for text in ds[text_field]]

    files = [p] if p.is_file() else sorted(f for f in p.rglob("*") if f.is_file())
    return _files_key(files, "hf", split, text_field), load


# ------------------------------------------------------------------ builders
# The signature is the DatasetSpec contract; the keyword arguments are the rank's.
def build_builtin(
    data_config: Any, tokenizer: Tokenizer, *, dp_rank: int, dp_world: int, seq_len: int, seed: int
) -> PackedTokenDataset:
    """The shipped corpus (the Python language reference); ``data.split`` is ``train``
    or ``validation`` (the last 5% of its tokens, which training never sees)."""
    return PackedTokenDataset(
        builtin_split(corpus_tokens(tokenizer), getattr(data_config, "split", "train")),
        source=f"the builtin corpus's {getattr(data_config, 'split', 'train')} split",
        dp_rank=dp_rank, dp_world=dp_world, seq_len=seq_len, seed=seed,
    )  # fmt: skip


def build_text(
    data_config: Any, tokenizer: Tokenizer, *, dp_rank: int, dp_world: int, seq_len: int, seed: int
) -> Any:
    """A ``.txt`` file, or every ``.txt`` file under a directory (one document each), streamed."""
    from titan_plugins.data.streaming import build_streaming

    return build_streaming(data_config, tokenizer, "text",
                           dp_rank=dp_rank, dp_world=dp_world, seq_len=seq_len, seed=seed)


def build_jsonl(
    data_config: Any, tokenizer: Tokenizer, *, dp_rank: int, dp_world: int, seq_len: int, seed: int
) -> Any:
    """A ``.jsonl`` file (or every one under a directory); ``data.text_field`` per line, streamed."""
    from titan_plugins.data.streaming import build_streaming

    return build_streaming(data_config, tokenizer, "jsonl",
                           dp_rank=dp_rank, dp_world=dp_world, seq_len=seq_len, seed=seed)


def build_parquet(
    data_config: Any, tokenizer: Tokenizer, *, dp_rank: int, dp_world: int, seq_len: int, seed: int
) -> Any:
    """A ``.parquet`` file (or every one under a directory), row group by row group."""
    from titan_plugins.data.streaming import build_streaming

    return build_streaming(data_config, tokenizer, "parquet",
                           dp_rank=dp_rank, dp_world=dp_world, seq_len=seq_len, seed=seed)


def build_hf(
    data_config: Any, tokenizer: Tokenizer, *, dp_rank: int, dp_world: int, seq_len: int, seed: int
) -> Any:
    """A local Hugging Face dataset (memory-mapped Arrow, read in row ranges);
    ``data.split`` and ``data.text_field`` pick the text."""
    from titan_plugins.data.streaming import build_streaming

    return build_streaming(data_config, tokenizer, "hf",
                           dp_rank=dp_rank, dp_world=dp_world, seq_len=seq_len, seed=seed)


def build_mix(
    data_config: Any, tokenizer: Tokenizer, *, dp_rank: int, dp_world: int, seq_len: int, seed: int
) -> Any:
    """``data.mix``: several streaming sources, each sample drawn by weight."""
    from titan_plugins.data.mix import build_mix as build

    return build(data_config, tokenizer, dp_rank=dp_rank, dp_world=dp_world, seq_len=seq_len, seed=seed)


def build_synthetic(
    data_config: Any,
    tokenizer: Tokenizer | None,
    *,
    dp_rank: int,
    dp_world: int,
    seq_len: int,
    seed: int,
) -> SyntheticTokenDataset:
    """Random tokens below ``data.vocab_size`` if the config has it, else the tokenizer's."""
    vocab_size = getattr(data_config, "vocab_size", None) or getattr(tokenizer, "vocab_size", None)
    if not vocab_size:
        raise ConfigError("data.name=synthetic needs a tokenizer or data.vocab_size")
    if getattr(data_config, "split", "train") != "train":  # other rows than training's: another seed
        seed = seed + 1 + sum(map(ord, str(data_config.split)))
    return SyntheticTokenDataset(
        int(vocab_size), dp_rank=dp_rank, dp_world=dp_world, seq_len=seq_len, seed=seed
    )
