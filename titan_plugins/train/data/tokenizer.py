"""A small byte-level BPE tokenizer (GPT-2 style) with no dependencies.

Text is split into chunks (words, numbers, punctuation runs, whitespace) by a
regex, each chunk's UTF-8 bytes start as tokens 0..255, and learned merges join
adjacent pairs. Merge ``k`` creates token ``256 + k``; the special tokens follow
the merges. Any text round-trips, since every byte is a token.

The file format (``tokenizer.json``) is ours, not Hugging Face's::

    {"format": "titan-byte-bpe", "version": 1, "pattern": "<regex>",
     "merges": [[a, b], ...], "special_tokens": {"<|bos|>": 2046, "<|eos|>": 2047}}
"""

from __future__ import annotations

import hashlib
import json
import re
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from titan_plugins.errors import ConfigError

FORMAT = "titan-byte-bpe"
ASSETS = Path(__file__).parent / "assets"
DEFAULT_TOKENIZER = ASSETS / "tokenizer.json"
# GPT-2's split, with `\w` classes instead of `\p{L}` (stdlib `re` has no
# Unicode properties) and identifiers kept whole (`__init__`): the corpus is
# Python documentation. The alternatives cover every character, so nothing is lost.
PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?[^\W\d]+| ?\d{1,3}| ?[^\s\w]+|\s+(?!\S)|\s+"""
SPECIAL_TOKENS = ("<|bos|>", "<|eos|>")
_CACHE_LIMIT = 200_000  # chunk -> ids entries kept before the cache is cleared


def _merge(ids: list[int], pair: tuple[int, int], new_id: int) -> list[int]:
    out: list[int] = []
    i = 0
    while i < len(ids):
        if i + 1 < len(ids) and ids[i] == pair[0] and ids[i + 1] == pair[1]:
            out.append(new_id)
            i += 2
        else:
            out.append(ids[i])
            i += 1
    return out


class Tokenizer:
    """Byte-level BPE: ``encode(text) -> list[int]``, ``decode(ids) -> str``.

    ``encode`` never adds or parses special tokens; callers add ``bos_id`` /
    ``eos_id`` around documents themselves.
    """

    def __init__(
        self,
        merges: Sequence[tuple[int, int]],
        special_tokens: Sequence[str] = SPECIAL_TOKENS,
        pattern: str = PATTERN,
    ) -> None:
        self.pattern = pattern
        self.merges = [tuple(pair) for pair in merges]
        self._split = re.compile(pattern)
        # A merge's rank is its new id, so "lowest rank first" is "lowest id first".
        self._ranks = {pair: 256 + k for k, pair in enumerate(self.merges)}
        self._bytes = [bytes([b]) for b in range(256)]
        for a, b in self.merges:
            self._bytes.append(self._bytes[a] + self._bytes[b])
        first_special = 256 + len(self.merges)
        self.special_tokens = {tok: first_special + k for k, tok in enumerate(special_tokens)}
        self._bytes.extend(tok.encode() for tok in special_tokens)
        self.vocab_size = len(self._bytes)
        self.bos_id = self.special_tokens.get("<|bos|>", -1)
        self.eos_id = self.special_tokens.get("<|eos|>", -1)
        self._cache: dict[str, list[int]] = {}

    # ------------------------------------------------------------------ coding
    def _encode_chunk(self, chunk: str) -> list[int]:
        ids = self._cache.get(chunk)
        if ids is not None:
            return ids
        ids = list(chunk.encode("utf-8"))
        ranks = self._ranks
        while len(ids) >= 2:
            pair = min(zip(ids, ids[1:]), key=lambda p: ranks.get(p, 1 << 30))
            if pair not in ranks:
                break
            ids = _merge(ids, pair, ranks[pair])
        if len(self._cache) >= _CACHE_LIMIT:
            self._cache.clear()
        self._cache[chunk] = ids
        return ids

    def encode(self, text: str) -> list[int]:
        out: list[int] = []
        for chunk in self._split.findall(text):
            out.extend(self._encode_chunk(chunk))
        return out

    def decode(self, ids: Iterable[int]) -> str:
        # Special tokens decode to their names; invalid UTF-8 (a cut-off
        # multi-byte character) to U+FFFD rather than an exception.
        return b"".join(self._bytes[int(i)] for i in ids).decode("utf-8", errors="replace")

    # ------------------------------------------------------------------ files
    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": 1,
            "pattern": self.pattern,
            "merges": [list(pair) for pair in self.merges],
            "special_tokens": self.special_tokens,
        }

    def save(self, path: str | Path) -> None:
        # One merge per line: small diffs when the tokenizer is rebuilt.
        d = self.to_dict()
        merges = ",\n    ".join(json.dumps(m) for m in d.pop("merges"))
        head = json.dumps(d, indent=2)[:-2]
        Path(path).write_text(f'{head},\n  "merges": [\n    {merges}\n  ]\n}}\n')

    @property
    def fingerprint(self) -> str:
        """A hash of what decides the token ids (for cache keys)."""
        blob = json.dumps(self.to_dict(), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    @classmethod
    def load(cls, path: str | Path, key: str = "data.tokenizer") -> Tokenizer:
        try:
            d = json.loads(Path(path).read_text())
        except FileNotFoundError:
            raise ConfigError(f"{key}={str(path)!r} does not exist") from None
        except (OSError, ValueError) as exc:
            raise ConfigError(f"{key}={str(path)!r} could not be read: {exc}") from None
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise ConfigError(
                f"{key}={str(path)!r} is not a {FORMAT} tokenizer file "
                "(make one with python -m titan_plugins.train.data.build_assets)"
            )
        specials = sorted(d["special_tokens"], key=d["special_tokens"].get)
        tok = cls(d["merges"], specials, d["pattern"])
        if tok.special_tokens != d["special_tokens"]:
            raise ConfigError(f"{key}={str(path)!r}: special token ids must follow the merges")
        return tok


def build_tokenizer(data_config: Any) -> Tokenizer:
    """The tokenizer ``data.tokenizer`` names, or the shipped one (vocab 2048)."""
    path = getattr(data_config, "tokenizer", None) or DEFAULT_TOKENIZER
    return Tokenizer.load(path)


def train_bpe(
    texts: Iterable[str], vocab_size: int, special_tokens: Sequence[str] = SPECIAL_TOKENS
) -> Tokenizer:
    """Learn ``vocab_size - 256 - len(special_tokens)`` merges from ``texts``.

    Counts pairs once over the distinct chunks, then updates only the chunks a
    merge touches, so 2k merges over ~0.5 MB take seconds, not minutes.
    """
    split = re.compile(PATTERN)
    counts = Counter(chunk for text in texts for chunk in split.findall(text))
    words = [list(chunk.encode("utf-8")) for chunk in counts]
    freqs = list(counts.values())
    pair_counts: Counter[tuple[int, int]] = Counter()
    where: defaultdict[tuple[int, int], set[int]] = defaultdict(set)
    for i, (word, freq) in enumerate(zip(words, freqs)):
        for pair in zip(word, word[1:]):
            pair_counts[pair] += freq
            where[pair].add(i)
    merges: list[tuple[int, int]] = []
    for new_id in range(256, vocab_size - len(special_tokens)):
        if not pair_counts:
            break
        # Ties go to the lowest ids, so the result does not depend on dict order.
        best = max(pair_counts, key=lambda p: (pair_counts[p], -p[0], -p[1]))
        merges.append(best)
        for i in sorted(where.pop(best)):
            word, freq = words[i], freqs[i]
            for pair in zip(word, word[1:]):
                pair_counts[pair] -= freq
                if pair_counts[pair] <= 0:
                    del pair_counts[pair]
            word = words[i] = _merge(word, best, new_id)
            for pair in zip(word, word[1:]):
                pair_counts[pair] += freq
                where[pair].add(i)
    return Tokenizer(merges, special_tokens)
