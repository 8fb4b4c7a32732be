"""Rows of the common chat layouts -> OpenAI-style ``[{"role", "content"}, ...]``.

Layouts (``data.chat.format``; ``auto`` picks the first whose field the row has):

- ``messages``: ``{"messages": [{"role": ..., "content": ...}, ...]}``, roles ``system``,
  ``user``, ``assistant``, ``tool``. Other keys of a message (``tool_calls``, ``name``,
  ``tool_call_id``, ``reasoning_content``) pass through to the template; an assistant
  message with ``tool_calls`` may have no content.
- ``sharegpt``: ``{"conversations": [{"from": ..., "value": ...}, ...]}``; ``human`` ->
  user, ``gpt`` -> assistant, ``function_call`` -> assistant, ``observation`` /
  ``function`` / ``function_response`` -> tool (the table ``SHAREGPT_ROLES``). A
  ``conversations`` list of role/content messages is read as ``messages``.
- ``instruction``: ``instruction`` (+ optional ``input``, joined with a blank line) ->
  user, ``output`` -> assistant; an optional ``system`` column becomes the system turn.
- ``prompt_completion``: ``prompt`` -> user, ``completion`` -> assistant (each a string
  or a list of messages, as TRL's conversational prompt/completion rows); optional
  ``system``.

Bad rows raise :class:`~titan_plugins.errors.ConfigError` with one line
``WHERE: FIELD: why`` (``WHERE`` is the caller's ``file:row``). A conversation with no
assistant turn raises :class:`NoAssistantTurn` (a ``ConfigError``): the chat data source
catches it, skips the row and counts it; every other error is fatal.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from titan_plugins.errors import ConfigError

ROLES = ("system", "user", "assistant", "tool")
FORMATS = ("auto", "messages", "sharegpt", "instruction", "prompt_completion")
SHAREGPT_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "model": "assistant",
    "chatgpt": "assistant",
    "function_call": "assistant",
    "tool": "tool",
    "function": "tool",
    "function_response": "tool",
    "observation": "tool",
    "ipython": "tool",
}
_PASS_THROUGH = ("tool_calls", "name", "tool_call_id", "reasoning_content")


class NoAssistantTurn(ConfigError):
    """The conversation has no assistant turn: nothing in it would train."""


@dataclass(frozen=True)
class ChatFields:
    """Which layout a row has and which columns hold what (``data.chat.*``).

    ``format``: one of ``FORMATS``. ``messages_field``: the column holding the message
    list (default ``messages``, or ``conversations`` for ShareGPT). The other names are
    the single-turn columns and the ShareGPT keys; override them for datasets that spell
    them differently.
    """

    format: str = "auto"
    messages_field: str | None = None
    system_field: str = "system"
    instruction_field: str = "instruction"
    input_field: str = "input"
    output_field: str = "output"
    prompt_field: str = "prompt"
    completion_field: str = "completion"

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise ConfigError(
                f"data.chat.format={self.format!r}: expected one of {', '.join(FORMATS)}"
            )

    @classmethod
    def from_config(cls, cfg: Any) -> ChatFields:
        """From a mapping or an object with these attributes (``data.chat``); missing or
        ``None`` values keep the defaults."""
        names = cls.__dataclass_fields__
        if cfg is None:
            return cls()
        get = cfg.get if isinstance(cfg, Mapping) else (lambda k, d=None: getattr(cfg, k, d))
        kwargs = {k: get(k, None) for k in names}
        return cls(**{k: v for k, v in kwargs.items() if v is not None})


def to_messages(row: Mapping, fields: ChatFields, *, where: str,
                require_assistant: bool = True) -> list[dict]:
    """A row of any supported layout -> ``[{"role", "content", ...}, ...]`` (new dicts).

    Raises ``ConfigError`` (one line naming ``where`` and the field) on a bad row and
    ``NoAssistantTurn`` when no message is an assistant's (unless ``require_assistant``
    is false: a prompt to generate from).
    """
    if not isinstance(row, Mapping):
        raise ConfigError(f"{where}: the row is a {type(row).__name__}, not an object")
    fmt = fields.format if fields.format != "auto" else _detect(row, fields, where)
    if fmt in ("messages", "sharegpt"):
        messages = _from_list(row, fields, fmt, where)
    elif fmt == "instruction":
        messages = _from_instruction(row, fields, where)
    else:
        messages = _from_prompt_completion(row, fields, where)
    if not messages:
        raise ConfigError(f"{where}: {_list_field(fields, fmt)}: the conversation is empty")
    if require_assistant and not any(m["role"] == "assistant" for m in messages):
        raise NoAssistantTurn(f"{where}: {_list_field(fields, fmt)}: no assistant turn")
    return messages


def to_tools(row: Mapping, *, where: str, field: str = "tools") -> list[dict] | None:
    """The row's tool definitions for the template's ``tools`` (None when it has none): a
    list of objects, or that list as a JSON string (as several datasets store it)."""
    value = row.get(field) if isinstance(row, Mapping) else None
    if value is None or value == "" or value == []:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise ConfigError(f"{where}: {field}: a string that is not JSON") from None
    if not isinstance(value, list | tuple) or not all(isinstance(t, Mapping) for t in value):
        raise ConfigError(f"{where}: {field}: expected a list of objects, got {_kind(value)}")
    return [dict(t) for t in value] or None


# ------------------------------------------------------------------ layouts
def _list_field(fields: ChatFields, fmt: str) -> str:
    if fields.messages_field:
        return fields.messages_field
    return {"sharegpt": "conversations", "instruction": fields.output_field,
            "prompt_completion": fields.completion_field}.get(fmt, "messages")


def _detect(row: Mapping, fields: ChatFields, where: str) -> str:
    if fields.messages_field:
        return "messages"
    if "messages" in row:
        return "messages"
    if "conversations" in row:
        return "sharegpt"
    if fields.instruction_field in row and fields.output_field in row:
        return "instruction"
    if fields.prompt_field in row and fields.completion_field in row:
        return "prompt_completion"
    keys = ", ".join(sorted(map(str, row))) or "none"
    raise ConfigError(
        f"{where}: messages: no 'messages' field (nor conversations, instruction/output or "
        f"prompt/completion; the row has: {keys})"
    )


def _from_list(row: Mapping, fields: ChatFields, fmt: str, where: str) -> list[dict]:
    key = _list_field(fields, fmt)
    if key not in row:
        keys = ", ".join(sorted(map(str, row))) or "none"
        raise ConfigError(f"{where}: {key}: no such field (the row has: {keys})")
    items = row[key]
    return _messages(items, key, where)


def _messages(items: Any, key: str, where: str) -> list[dict]:
    if not isinstance(items, list | tuple):
        raise ConfigError(f"{where}: {key}: expected a list of messages, got {_kind(items)}")
    out = []
    for i, m in enumerate(items):
        out.append(_message(m, f"{key}[{i}]", where))
    return out


def _message(m: Any, field: str, where: str) -> dict:
    if not isinstance(m, Mapping):
        raise ConfigError(f"{where}: {field}: expected an object, got {_kind(m)}")
    if "role" in m:
        role = m["role"]
        if role not in ROLES:
            raise ConfigError(
                f"{where}: {field}.role={role!r}: unknown role (expected {', '.join(ROLES)})"
            )
        content_key = "content"
    elif "from" in m:
        role = SHAREGPT_ROLES.get(m["from"]) if isinstance(m["from"], str) else None
        if role is None:
            raise ConfigError(
                f"{where}: {field}.from={m['from']!r}: unknown role "
                f"(expected one of {', '.join(SHAREGPT_ROLES)})"
            )
        content_key = "value"
    else:
        raise ConfigError(f"{where}: {field}: no 'role' (or ShareGPT 'from') key")
    content = m.get(content_key)
    msg: dict[str, Any] = {"role": role}
    for k in _PASS_THROUGH:
        if m.get(k) is not None:
            msg[k] = m[k]
    if content is None and role == "assistant" and msg.get("tool_calls"):
        return msg  # an OpenAI tool-call turn: no text
    if content is None:
        raise ConfigError(f"{where}: {field}.{content_key}: missing")
    if not isinstance(content, str):
        raise ConfigError(
            f"{where}: {field}.{content_key}: expected a string, got {_kind(content)}"
        )
    msg["content"] = content
    return msg


def _text(row: Mapping, key: str, where: str, *, required: bool) -> str | None:
    value = row.get(key)
    if value is None:
        if required:
            raise ConfigError(f"{where}: {key}: missing")
        return None
    if not isinstance(value, str):
        raise ConfigError(f"{where}: {key}: expected a string, got {_kind(value)}")
    return value


def _system(row: Mapping, fields: ChatFields, where: str) -> list[dict]:
    system = _text(row, fields.system_field, where, required=False)
    return [{"role": "system", "content": system}] if system else []


def _from_instruction(row: Mapping, fields: ChatFields, where: str) -> list[dict]:
    instruction = _text(row, fields.instruction_field, where, required=True)
    extra = _text(row, fields.input_field, where, required=False)
    output = _text(row, fields.output_field, where, required=True)
    user = f"{instruction}\n\n{extra}" if extra else instruction
    return [*_system(row, fields, where), {"role": "user", "content": user},
            {"role": "assistant", "content": output}]


def _from_prompt_completion(row: Mapping, fields: ChatFields, where: str) -> list[dict]:
    out = _system(row, fields, where)
    for key, role in ((fields.prompt_field, "user"), (fields.completion_field, "assistant")):
        value = row.get(key)
        if isinstance(value, list | tuple):
            out += _messages(value, key, where)
        else:
            text = _text(row, key, where, required=True)
            out.append({"role": role, "content": text})
    return out


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean",
            int: "a number", float: "a number"}.get(type(value), type(value).__name__)
