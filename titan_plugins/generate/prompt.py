"""Prompts are tokenized as transformers tokenizes them, which is how training starts a
document.

The tokenizer's own rules (``titan_plugins.data.special_ids``) say what it adds before
a text: Llama 3's ``<|begin_of_text|>``, Gemma's ``<bos>``, nothing for Qwen3. Training
packs every document as that prefix, the text, EOS; ``encode_prompt`` gives the prefix
and the text (``tokenizer(text)`` of transformers, without what it may add after a
text). ``document_start`` is what a text with no context at all is scored after: the
prefix, else the EOS a document follows in a packed row (lm-eval's ``prefix_token_id``).
"""

from __future__ import annotations

from typing import Any

__all__ = ["document_start", "encode_prompt", "text_prefix"]


def _id(tokenizer: Any, name: str) -> int:
    value = getattr(tokenizer, name, None)
    return int(value) if value is not None and int(value) >= 0 else -1


def text_prefix(tokenizer: Any) -> list[int]:
    """What the tokenizer adds before a text: ``Tokenizer.prefix`` (a duck-typed
    tokenizer without one: ``[bos_id]`` where it has a BOS)."""
    prefix = getattr(tokenizer, "prefix", None)
    if prefix is not None:
        return [int(i) for i in prefix]
    bos = _id(tokenizer, "bos_id")
    return [bos] if bos >= 0 else []


def document_start(tokenizer: Any) -> list[int]:
    """What a text with no context follows: ``text_prefix``, else ``[eos_id]``, else nothing."""
    prefix = text_prefix(tokenizer)
    if prefix:
        return prefix
    eos = _id(tokenizer, "eos_id")
    return [eos] if eos >= 0 else []


def encode_prompt(tokenizer: Any, text: str) -> list[int]:
    """``text`` as the start of a training document: ``text_prefix`` + its ids."""
    return text_prefix(tokenizer) + list(tokenizer.encode(text))
