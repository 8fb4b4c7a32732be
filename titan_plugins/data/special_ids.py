"""BOS / EOS / pad of a tokenizer folder, and what its tokenizer adds to a text: the one
place these rules live (training, titan-generate, titan-eval, the lm-eval adapter and
the export all read them through ``Tokenizer``).

The rules are the ones transformers 5 applies when it loads the same folder with
``AutoTokenizer`` (measured against transformers 5.25, tests/test_special_ids.py):

1. **What a text gets.** ``tokenizer(text)`` adds exactly what ``tokenizer.json``'s
   post-processor adds: ``<|begin_of_text|>`` for Llama 3, ``<bos>`` for Gemma,
   ``<s>`` for Mistral, nothing for Qwen3 (a ``ByteLevel`` post-processor only).
   transformers 5 ignores ``add_bos_token`` / ``add_eos_token`` of
   ``tokenizer_config.json`` when the folder has a ``tokenizer.json`` (it pops them),
   so we do too; released folders agree with their post-processor anyway.
2. **Which token is BOS / EOS / pad.** ``tokenizer_config.json``'s ``bos_token`` /
   ``eos_token`` / ``pad_token`` (then ``special_tokens_map.json``) where the key is
   present: a ``null`` means "none" (Qwen3's ``bos_token: null``), whatever
   config.json says. Where the tokenizer files say nothing: the post-processor's
   leading/trailing token, ``tokenizer.json``'s padding, then ``config.json``, then
   ``generation_config.json`` ids (a list: its first id), and for EOS last the usual
   names among its special tokens (``<|eos|>``, ``</s>``, ...; packing needs one).
   A named BOS is only added where rule 1 adds it.
3. **A bare tokenizer.json** (no ``tokenizer_config.json``: one ``train_tokenizer`` or
   ``train_bpe`` made, the shipped one) keeps the project's convention: the usual names
   give BOS, EOS and padding, and documents are written ``BOS text EOS``.

Documents packed for training are ``prefix text EOS``: ``prefix`` is what rule 1 adds
before a text (so a packed document starts as ``tokenizer(text)`` does), EOS the
document separator.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["SpecialIds", "added_by_post_processor", "read_json", "resolve_special_ids"]

_NAMES = {
    "bos": ("<|bos|>", "<|begin_of_text|>", "<s>", "<bos>", "<|startoftext|>"),
    "eos": ("<|eos|>", "<|end_of_text|>", "<|endoftext|>", "</s>", "<eos>", "<|im_end|>"),
    "pad": ("<|pad|>", "<pad>", "[PAD]", "<|finetune_right_pad_id|>"),
}
_KINDS = ("bos", "eos", "pad")


@dataclass(frozen=True)
class SpecialIds:
    """``bos`` / ``eos`` / ``pad``: the tokens' ids (-1: none). ``prefix`` / ``suffix``:
    the ids the tokenizer adds before / after a text (rule 1). ``from_``: where each of
    the three came from (``tokenizer_config.json``, ``post-processor``, ``config.json``,
    ...), for messages. ``eos_list``: every id config.json / generation_config.json
    names as an end of generation (Llama 3.1 Instruct: three), the EOS first."""

    bos: int = -1
    eos: int = -1
    pad: int = -1
    prefix: tuple[int, ...] = ()
    suffix: tuple[int, ...] = ()
    from_: Mapping[str, str] = field(default_factory=dict)
    eos_list: tuple[int, ...] = ()


def read_json(path: Path) -> dict[str, Any] | None:
    """The file's JSON object; None where it is missing or not an object."""
    try:
        data = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _token_name(value: Any) -> str | None:
    if isinstance(value, Mapping):  # the AddedToken form {"content": ...}
        value = value.get("content")
    return value if isinstance(value, str) else None


def added_by_post_processor(tok: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The ids ``tok``'s post-processor puts before and after a one-token text."""
    plain = tok.encode("a", add_special_tokens=False).ids
    full = tok.encode("a", add_special_tokens=True).ids
    if not plain or full == plain:
        return (), ()
    n = len(plain)
    for start in range(len(full) - n + 1):
        if full[start:start + n] == plain:
            return tuple(full[:start]), tuple(full[start + n:])
    return (), ()


def _config_ids(folder: Path | None) -> tuple[dict[str, int], list[int]]:
    """``bos``/``eos``/``pad`` ids of config.json, then generation_config.json for what it
    leaves out (a list: its first id), and every EOS id both name, in order."""
    out: dict[str, int] = {}
    eos_all: list[int] = []
    for name in ("config.json", "generation_config.json"):
        data = (read_json(folder / name) if folder else None) or {}
        for kind in _KINDS:
            value = data.get(f"{kind}_token_id")
            values = value if isinstance(value, list) else [value]
            values = [v for v in values if isinstance(v, int) and not isinstance(v, bool)]
            if kind == "eos":
                eos_all += [v for v in values if v not in eos_all]
            if values:
                out.setdefault(kind, values[0])
    return out, eos_all


def resolve_special_ids(tok: Any, folder: Path | None) -> SpecialIds:
    """The rules of the module docstring for ``tok`` (a ``tokenizers.Tokenizer``) loaded
    from ``folder`` (its tokenizer.json's folder; None: a tokenizer not from a file)."""
    vocab = int(tok.get_vocab_size(with_added_tokens=True))
    config = read_json(folder / "tokenizer_config.json") if folder else None
    special_map = (read_json(folder / "special_tokens_map.json") if folder else None) or {}
    prefix, suffix = added_by_post_processor(tok)
    stated, eos_all = _config_ids(folder)
    padding = tok.padding["pad_id"] if tok.padding else None
    fallback = {"bos": prefix[0] if prefix else None, "eos": suffix[-1] if suffix else None,
                "pad": padding}
    fallback_from = {"bos": "post-processor", "eos": "post-processor", "pad": "tokenizer.json padding"}
    specials = {t.content for t in tok.get_added_tokens_decoder().values() if t.special}

    def valid(i: Any) -> bool:
        return isinstance(i, int) and 0 <= i < vocab

    ids: dict[str, int] = {}
    origin: dict[str, str] = {}
    for kind in _KINDS:
        key = f"{kind}_token"
        for where, source in (("tokenizer_config.json", config), ("special_tokens_map.json", special_map)):
            if source is not None and key in source:
                name = _token_name(source[key])
                found = tok.token_to_id(name) if name is not None else None
                if name is None or found is not None:  # null: the tokenizer has none
                    ids[kind], origin[kind] = (int(found) if found is not None else -1), where
                    break
        if kind in ids:
            continue
        if valid(fallback[kind]):
            ids[kind], origin[kind] = int(fallback[kind]), fallback_from[kind]
        elif valid(stated.get(kind)):
            ids[kind], origin[kind] = stated[kind], "config.json/generation_config.json"
        elif config is None or kind == "eos":  # nothing says: the usual names (a bare
            # tokenizer.json relies on them; packing needs an EOS)
            name = next((n for n in _NAMES[kind] if n in specials), None)
            ids[kind] = int(tok.token_to_id(name)) if name is not None else -1
            origin[kind] = "special-token names" if name is not None else "none"
        else:
            ids[kind], origin[kind] = -1, "none"
    if config is None and not prefix and ids["bos"] >= 0:
        prefix = (ids["bos"],)  # rule 3: documents start with BOS
    eos_list = [ids["eos"]] if ids["eos"] >= 0 else []
    eos_list += [i for i in eos_all if valid(i) and i not in eos_list]
    return SpecialIds(bos=ids["bos"], eos=ids["eos"], pad=ids["pad"], prefix=tuple(prefix),
                      suffix=tuple(suffix), from_=origin, eos_list=tuple(eos_list))

