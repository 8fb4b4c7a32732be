"""A conversation as a generation prompt (``titan-generate --chat`` / ``--messages``).

The prompt is the conversation rendered by the run's chat template with the assistant
header appended (``add_generation_prompt=True``), tokenized as in training; generation
stops at the token that closes an assistant turn (``<|im_end|>``, ``<|eot_id|>``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from titan_plugins.chat.encode import encode_prompt, end_of_turn_ids
from titan_plugins.chat.formats import ChatFields, to_messages
from titan_plugins.chat.template import ChatTemplate, load_chat_template
from titan_plugins.errors import ConfigError

CHAT_DATA = ("chat", "chat_sample", "preference", "preference_sample")  # runs that trained on chats


def read_messages(path: str | Path, *, key: str = "--messages") -> list[dict]:
    """A JSON file: a list of messages, or an object in any layout ``to_messages`` reads
    (``{"messages": [...]}``, ShareGPT ``conversations``, ...); a ``.jsonl``: its first line."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{key}={path}: no such file")
    text = p.read_text(encoding="utf-8")
    if p.suffix == ".jsonl":
        text = next((line for line in text.splitlines() if line.strip()), "")
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise ConfigError(f"{key}={path}: not JSON ({exc})") from None
    row = {"messages": value} if isinstance(value, list) else value
    return to_messages(row, ChatFields(), where=f"{key}={path}", require_assistant=False)


def template_for(data_config: Any, spec: str | None, *, key: str = "--chat-template") -> ChatTemplate:
    """The template a run trained with: ``spec`` (a file or a name), else the run's
    ``data.chat.template``, else its tokenizer folder's own (``data.tokenizer``; chat runs
    without one use the shipped ChatML tokenizer folder)."""
    from titan_plugins.data.tokenizer import ASSETS

    chat = _get(data_config, "chat")
    spec = spec or (_get(chat, "template") if chat is not None else None)
    folder = _get(data_config, "tokenizer")
    if not folder and _get(data_config, "name") in CHAT_DATA:
        folder = ASSETS / "chat_tokenizer"
    return load_chat_template(spec, folder, key=key)


def chat_prompt(messages: list[dict], template: ChatTemplate, tokenizer: Any
                ) -> tuple[list[int], int | None]:
    """The prompt ids and the id that ends the reply (None: the tokenizer's EOS)."""
    if not messages:
        raise ConfigError("--chat: the conversation is empty")
    ids = encode_prompt(messages, template, tokenizer)
    stop = end_of_turn_ids(template, tokenizer)
    return ids, (stop[0] if len(stop) == 1 else None)


def _get(obj: Any, name: str) -> Any:
    if obj is None:
        return None
    if isinstance(obj, Mapping):
        return obj.get(name)
    try:
        return getattr(obj, name, None)
    except Exception:  # a DictConfig missing key in struct mode
        return None
