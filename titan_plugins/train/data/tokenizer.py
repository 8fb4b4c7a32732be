"""Tokenizers: any Hugging Face ``tokenizer.json``, through the ``tokenizers`` library.

``data.tokenizer`` is a ``tokenizer.json`` or a folder holding one (a Hugging
Face model folder; ``model.hf`` sets it). The shipped tokenizer is such a file:
byte-level BPE (GPT-2 style) trained with ``tokenizers``' own trainer on the
shipped corpus, its special tokens ``<|bos|>`` / ``<|eos|>`` appended last
(ids 2046/2047), so every text round-trips.

BOS/EOS/padding ids come from what the files state: ``tokenizer_config.json`` next to
the file when it names them, else the ids ``config.json`` (then
``generation_config.json``) of a Hugging Face folder gives, else the post-processor's
template, and only then the usual names among its special tokens. ``encode`` never adds special tokens;
document packing adds ``bos_id`` / ``eos_id`` itself where they exist.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from titan_plugins.errors import ConfigError

ASSETS = Path(__file__).parent / "assets"
DEFAULT_TOKENIZER = ASSETS / "tokenizer.json"
SPECIAL_TOKENS = ("<|bos|>", "<|eos|>")
_BOS_NAMES = ("<|bos|>", "<|begin_of_text|>", "<s>", "<bos>", "<|startoftext|>")
_EOS_NAMES = ("<|eos|>", "<|end_of_text|>", "<|endoftext|>", "</s>", "<eos>", "<|im_end|>")
_PAD_NAMES = ("<|pad|>", "<pad>", "[PAD]", "<|finetune_right_pad_id|>")


def _token_name(value: Any) -> str | None:
    if isinstance(value, dict):  # tokenizer_config.json's AddedToken form
        value = value.get("content")
    return value if isinstance(value, str) else None


class Tokenizer:
    """A ``tokenizers.Tokenizer`` with the ids a trainer needs.

    ``encode(text) -> list[int]``, ``encode_batch(texts) -> list[list[int]]`` (in
    Rust, parallel), ``decode(ids) -> str``; ``vocab_size``, ``bos_id``, ``eos_id``,
    ``pad_id`` (-1 where the tokenizer has none).
    """

    def __init__(self, tok: Any, config: dict[str, Any] | None = None,
                 ids: dict[str, int] | None = None) -> None:
        self.tok = tok
        config, ids = config or {}, ids or {}
        self.vocab_size = int(tok.get_vocab_size(with_added_tokens=True))
        template = self._template_ids()

        def stated(kind: str, fallback: int | None) -> int | None:
            value = ids.get(kind)
            return value if isinstance(value, int) and 0 <= value < self.vocab_size else fallback

        self.bos_id = self._special(config.get("bos_token"), _BOS_NAMES, stated("bos", template[0]))
        self.eos_id = self._special(config.get("eos_token"), _EOS_NAMES, stated("eos", template[1]))
        pad = tok.padding["pad_id"] if tok.padding else None
        self.pad_id = self._special(config.get("pad_token"), _PAD_NAMES, stated("pad", pad))
        if self.pad_id < 0:
            self.pad_id = self.eos_id

    # -------------------------------------------------------------- specials
    def _template_ids(self) -> tuple[int | None, int | None]:
        """What the post-processor puts before and after a text, if anything."""
        with_specials = self.tok.encode("a", add_special_tokens=True).ids
        plain = self.tok.encode("a", add_special_tokens=False).ids
        if with_specials == plain or not plain:
            return None, None
        n = len(plain)
        for start in range(len(with_specials) - n + 1):
            if with_specials[start : start + n] == plain:
                before, after = with_specials[:start], with_specials[start + n :]
                return (before[0] if before else None), (after[-1] if after else None)
        return None, None

    def _special(self, configured: Any, names: Sequence[str], fallback: int | None) -> int:
        name = _token_name(configured)
        if name is not None and self.tok.token_to_id(name) is not None:
            return int(self.tok.token_to_id(name))
        if fallback is not None:
            return int(fallback)
        specials = {t.content for t in self.tok.get_added_tokens_decoder().values() if t.special}
        for name in names:
            if name in specials:
                return int(self.tok.token_to_id(name))
        return -1

    def special_name(self, token_id: int) -> str | None:
        """The special (added) token ``token_id`` is, if it is one: text never encodes
        to it, so it is in the data only where the packer puts it (BOS, EOS)."""
        token = self.tok.get_added_tokens_decoder().get(int(token_id))
        return token.content if token is not None and token.special else None

    # ------------------------------------------------------------------ coding
    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self.tok.encode_batch_fast(list(texts), add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=False)

    # ------------------------------------------------------------------ files
    @property
    def merges(self) -> list[Any]:
        """The BPE merges (empty for other models)."""
        return json.loads(self.tok.to_str())["model"].get("merges") or []

    def save(self, path: str | Path) -> None:
        self.tok.save(str(path), pretty=True)

    @property
    def fingerprint(self) -> str:
        """A hash of what decides the token ids (for cache keys)."""
        blob = f"{self.tok.to_str()}|{self.bos_id}|{self.eos_id}".encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    @classmethod
    def load(cls, path: str | Path, key: str = "data.tokenizer") -> Tokenizer:
        """A ``tokenizer.json`` or a folder holding one; errors name ``key``."""
        from tokenizers import Tokenizer as HFTokenizer

        p = Path(path).expanduser()
        if p.is_dir():
            p = p / "tokenizer.json"
        if not p.is_file():
            raise ConfigError(f"{key}={str(path)!r} does not exist")
        try:
            tok = HFTokenizer.from_file(str(p))
        except Exception as exc:  # tokenizers raises a bare Exception on a bad file
            first = (str(exc).strip() or type(exc).__name__).splitlines()[0]
            raise ConfigError(
                f"{key}={str(path)!r} is not a Hugging Face tokenizer.json ({first})"
            ) from None
        return cls(tok, _read_json(p.parent / "tokenizer_config.json"), _stated_ids(p.parent))


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _stated_ids(folder: Path) -> dict[str, int]:
    """``bos``/``eos``/``pad`` ids a Hugging Face folder's ``config.json`` states, then
    ``generation_config.json`` for what it leaves out (a list: its first id)."""
    out: dict[str, int] = {}
    for name in ("config.json", "generation_config.json"):
        data = _read_json(folder / name)
        for kind in ("bos", "eos", "pad"):
            value = data.get(f"{kind}_token_id")
            if isinstance(value, list):
                value = value[0] if value else None
            if isinstance(value, int) and not isinstance(value, bool):
                out.setdefault(kind, value)
    return out


def build_tokenizer(data_config: Any) -> Tokenizer:
    """The tokenizer ``data.tokenizer`` names, or the shipped one (vocab 2048; for chat
    data its ChatML variant, ``assets/chat_tokenizer``)."""
    chat = getattr(data_config, "name", None) in ("chat", "chat_sample")
    path = getattr(data_config, "tokenizer", None) or (ASSETS / "chat_tokenizer" if chat else DEFAULT_TOKENIZER)
    return Tokenizer.load(path)


def train_bpe(
    texts: Iterable[str], vocab_size: int, special_tokens: Sequence[str] = SPECIAL_TOKENS
) -> Tokenizer:
    """Byte-level BPE learned with ``tokenizers``' trainer: 256 bytes, then merges,
    then ``special_tokens`` last, ``vocab_size`` ids in all (fewer if ``texts``
    run out of pairs). Deterministic for the same texts."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(special_tokens),
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tok.train_from_iterator(texts, trainer=trainer)
    tok.add_special_tokens(list(special_tokens))
    return Tokenizer(tok)
