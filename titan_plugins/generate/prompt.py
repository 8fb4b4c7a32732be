"""Prompts are tokenized as training tokenized documents.

The packer writes every training document as ``BOS text EOS`` (BOS and EOS where the
tokenizer has them), so a document's first token always followed BOS, or, with a
tokenizer without BOS, the previous document's EOS. A prompt is the start of a
document: the same prefix, then the text's ids (``encode`` adds no special tokens).
"""

from __future__ import annotations

from typing import Any

__all__ = ["document_start", "encode_prompt"]


def _id(tokenizer: Any, name: str) -> int:
    value = getattr(tokenizer, name, None)
    return int(value) if value is not None and int(value) >= 0 else -1


def document_start(tokenizer: Any) -> list[int]:
    """What a training document's first token follows: ``[bos_id]``, else ``[eos_id]``,
    else nothing."""
    for name in ("bos_id", "eos_id"):
        if (token := _id(tokenizer, name)) >= 0:
            return [token]
    return []


def encode_prompt(tokenizer: Any, text: str) -> list[int]:
    """``text`` as the start of a training document: ``document_start`` + its ids."""
    return document_start(tokenizer) + list(tokenizer.encode(text))
