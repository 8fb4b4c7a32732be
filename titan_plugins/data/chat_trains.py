"""Before launch: a chat file holds a row that trains (``data.name=chat``, ``chat_sample``
and the chat entries of ``data.mix``; ``data/check.py`` asks, through
``chat_source.check_chat_source(..., every_row=True)``).

The chat source skips a conversation in two cases (``chat_source.ChatDataset.encode``):
``chat.formats.to_messages`` raises ``NoAssistantTurn`` (no message whose role, after the
layout's role table, is ``assistant``; ``train_on=all`` skips these too), or the loss mask of
``chat.encode.encode_conversation`` under ``data.chat.train_on`` marks no target. A file of
only such rows used to stop the run after launch with "holds 0 tokens". Here the rows are
read in order, through the same two functions, until one trains; a file where none does is
one line naming it and why.

Cost: a file whose first row trains renders that one row. A row without an assistant turn
costs its parse (a file with none is read to its end, as the run would read it); at most
``RENDERED`` rows with an assistant turn are rendered, past them the rest is left to the run.
Truncation to ``training.seq_len`` is the run's to count (``no target``), not checked here.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from titan_plugins.chat.encode import encode_conversation
from titan_plugins.chat.formats import ChatFields, NoAssistantTurn, to_messages
from titan_plugins.errors import ConfigError

__all__ = ["RENDERED", "require_a_trained_row"]

RENDERED = 32  # rows with an assistant turn rendered at most before the check gives up
_ROLES_FROM = 16  # rows whose roles are listed in the message


def require_a_trained_row(rows: Iterable[tuple[Mapping, str]], fields: ChatFields, template: Any,
                          tokenizer: Any, train_on: str, *, key: str) -> None:
    """Raise one ``ConfigError`` naming ``key`` (``data.path=PATH``) when no row of ``rows``
    has an assistant turn, or none that has one gets a target from the loss mask."""
    read, without, untargeted, roles = 0, 0, 0, set()
    for row, where in rows:
        read += 1
        try:
            messages = to_messages(row, fields, where=where)
        except NoAssistantTurn:
            without += 1
            if without <= _ROLES_FROM:
                roles.update(str(m.get("role")) for m in to_messages(row, fields, where=where,
                                                                       require_assistant=False))
            continue
        tools = row.get("tools") if isinstance(row, Mapping) else None
        _, mask = encode_conversation(messages, template, tokenizer, train_on=train_on, tools=tools or None,
                                      where=where)
        if any(mask[1:]):  # the first token is never a label
            return
        untargeted += 1
        if untargeted >= RENDERED:
            return  # not concluded: the run counts what it skips
    if read == 0:
        return  # an empty source is check_chat_source's to say
    if untargeted == 0:
        seen = ", ".join(sorted(roles)) or "none"
        raise ConfigError(
            f"{key}: no row has an assistant turn to train on ({read} rows, roles: {seen}); the loss "
            "counts only assistant turns and a conversation without one is skipped")
    raise ConfigError(
        f"{key}: no row has a token to train on ({read} rows: {without} without an assistant turn, "
        f"{untargeted} whose assistant turns the template's loss mask leaves empty under "
        f"data.chat.train_on={train_on})")
