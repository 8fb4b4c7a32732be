"""Tokenizers: any Hugging Face ``tokenizer.json``, through the ``tokenizers`` library.

``data.tokenizer`` is a ``tokenizer.json`` or a folder holding one (a Hugging
Face model folder; ``model.hf`` sets it). The shipped tokenizer is such a file:
byte-level BPE (GPT-2 style) trained with ``tokenizers``' own trainer on the
shipped corpus, its special tokens ``<|bos|>`` / ``<|eos|>`` appended last
(ids 2046/2047), so every text round-trips.

Which tokens are BOS/EOS/padding, and what the tokenizer adds before a text, follow
transformers' rules, written once in ``titan_plugins.data.special_ids``. ``encode``
never adds special tokens; ``encode_text`` adds what transformers' ``tokenizer(text)``
adds; document packing writes ``prefix`` (``bos_id``) and ``eos_id`` itself.
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


class Tokenizer:
    """A ``tokenizers.Tokenizer`` with the ids a trainer needs.

    ``encode(text) -> list[int]`` (no special tokens), ``encode_text(text)`` (what
    transformers' ``tokenizer(text)`` gives: ``prefix`` + ids + ``suffix``),
    ``encode_batch(texts)`` (in Rust, parallel), ``decode(ids) -> str``; ``vocab_size``.
    Ids (-1 where there is none), by ``special_ids``' rules:

    - ``bos_id``: the BOS the tokenizer adds before a text (what a packed document and a
      prompt start with); -1 where it adds none, even if it names one (Qwen3: none;
      Phi-3.5: ``<s>`` named, not added). ``bos_token_id``: the named BOS.
    - ``eos_id``: its EOS (the document separator); ``eos_ids``: that and every other id
      config.json / generation_config.json end generation with.
    - ``pad_id``: its padding token, else ``eos_id`` (rows need some id);
      ``stated_pad_id``: the padding token the files name (-1: none).
    """

    def __init__(self, tok: Any, folder: str | Path | None = None) -> None:
        from titan_plugins.data.special_ids import resolve_special_ids

        self.tok = tok
        self.vocab_size = int(tok.get_vocab_size(with_added_tokens=True))
        ids = resolve_special_ids(tok, Path(folder) if folder is not None else None)
        self.special = ids
        self.prefix, self.suffix = ids.prefix, ids.suffix
        self.bos_id = ids.prefix[0] if ids.prefix else -1
        self.bos_token_id, self.eos_id, self.stated_pad_id = ids.bos, ids.eos, ids.pad
        self.eos_ids = ids.eos_list
        self.pad_id = ids.pad if ids.pad >= 0 else self.eos_id

    def special_name(self, token_id: int) -> str | None:
        """The special (added) token ``token_id`` is, if it is one: text never encodes
        to it, so it is in the data only where the packer puts it (BOS, EOS)."""
        token = self.tok.get_added_tokens_decoder().get(int(token_id))
        return token.content if token is not None and token.special else None

    # ------------------------------------------------------------------ coding
    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def encode_text(self, text: str) -> list[int]:
        """``text`` as transformers' ``tokenizer(text)`` gives it (what the tokenizer adds)."""
        return [*self.prefix, *self.encode(text), *self.suffix]

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
        return cls(tok, p.parent)


def build_tokenizer(data_config: Any) -> Tokenizer:
    """The tokenizer ``data.tokenizer`` names, or the shipped one (vocab 2048; for chat
    preference and prompts data its ChatML variant, ``assets/chat_tokenizer``)."""
    chat = getattr(data_config, "name", None) in ("chat", "chat_sample", "preference", "preference_sample",
                                                 "prompts")
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
