"""A conversation -> token ids and a loss mask, through the model's chat template.

``ids`` are what ``AutoTokenizer.apply_chat_template(messages, tokenize=True)`` returns:
the template's text encoded once, without the tokenizer's own BOS/EOS (the template
writes those it wants), special tokens in the text encoded as special tokens.

``mask[i]`` says whether token ``i``, as a prediction target, counts in the loss.
``train_on``:

- ``assistant`` (default): every assistant turn, from the first token after the
  assistant header (``<|im_start|>assistant\\n``, ``<|start_header_id|>assistant
  <|end_header_id|>\\n\\n``) through the end-of-turn token that stops generation
  (``<|im_end|>``, ``<|eot_id|>``). Whitespace the template writes after that token
  (ChatML's newline) does not count. Text a template inserts in an assistant turn
  (Qwen3's empty ``<think>\\n\\n</think>\\n\\n`` in the last turn) counts: the model
  writes it.
- ``last_assistant``: only the final assistant turn.
- ``all``: every token.

How the assistant spans are found, for any template: if it marks assistant text with
``{% generation %}`` blocks, those blocks (as ``return_assistant_tokens_mask``).
Otherwise by rendering the conversation turn by turn: turn ``k`` starts where
``render(messages[:k], add_generation_prompt=True)`` ends and ends where
``render(messages[:k+1])`` ends, each checked to be a prefix of the whole render. Text
the template writes only after the last message to close the conversation (Phi-3.5's
``eos_token``) is measured once (a rendering with one more user turn lacks it there)
and belongs to no turn: it is cut from each rendering before the prefix check. A
template that renders a turn differently when it is last (Qwen3 keeps ``<think>`` only
after the last user query) fails that check for earlier turns; then the turn's end is
where a following user turn starts (``messages[:k+1]`` + a probe user message, its
header measured from a second probe), checked again against the whole render. A turn
that no rule places is a ``ConfigError`` naming the row and message
(``train_on=all`` or a template with ``{% generation %}`` blocks avoid it).
A token counts when its characters overlap a span (transformers' rule).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from titan_plugins.chat.template import ChatTemplate
from titan_plugins.errors import ConfigError

TRAIN_ON = ("assistant", "last_assistant", "all")
_PROBE = "\u2063titan probe\u2063"  # text no template trims and no conversation holds


def encode_conversation(
    messages: Sequence[Mapping], template: ChatTemplate, tokenizer: Any, *,
    train_on: str = "assistant", tools: Sequence[Mapping] | None = None, where: str = "",
) -> tuple[list[int], list[bool]]:
    """Token ids of the rendered conversation and, per token, whether it counts in the loss.

    ``tokenizer``: the project's ``Tokenizer`` (or a ``tokenizers.Tokenizer``). ``where``
    (``file:row``) prefixes error messages.
    """
    if train_on not in TRAIN_ON:
        raise ConfigError(f"data.chat.train_on={train_on!r}: expected one of {', '.join(TRAIN_ON)}")
    if train_on == "all":
        text, spans = _render(template, messages, tools, where), []
    else:
        text, spans = assistant_spans(messages, template, tools=tools, where=where,
                                      last_only=train_on == "last_assistant", tokenizer=tokenizer)
    enc = _backend(tokenizer).encode(text, add_special_tokens=False)
    if train_on == "all":
        return list(enc.ids), [True] * len(enc.ids)
    return list(enc.ids), _mask(enc.offsets, spans)


def encode_prompt(messages: Sequence[Mapping], template: ChatTemplate, tokenizer: Any, *,
                  tools: Sequence[Mapping] | None = None) -> list[int]:
    """Ids of the conversation followed by the assistant header (to generate a reply)."""
    text = template.render(messages, add_generation_prompt=True, tools=tools)
    return list(_backend(tokenizer).encode(text, add_special_tokens=False).ids)


def end_of_turn_ids(template: ChatTemplate, tokenizer: Any) -> list[int]:
    """The token(s) that close an assistant turn (``<|im_end|>``, ``<|eot_id|>``): what
    follows the reply in a probe conversation, up to the end of the assistant span."""
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": _PROBE}]
    try:
        text, spans = assistant_spans(messages, template, tokenizer=tokenizer)
    except ConfigError:
        return []
    if not spans:
        return []
    start = text.find(_PROBE, spans[-1][0]) + len(_PROBE)
    enc = _backend(tokenizer).encode(text, add_special_tokens=False)
    return [i for i, (a, b) in zip(enc.ids, enc.offsets) if a >= start and b <= spans[-1][1]
            and b > a]


def assistant_spans(
    messages: Sequence[Mapping], template: ChatTemplate, *,
    tools: Sequence[Mapping] | None = None, where: str = "", last_only: bool = False,
    tokenizer: Any = None,
) -> tuple[str, list[tuple[int, int]]]:
    """The whole render and the character spans ``[start, end)`` of its assistant turns
    (``tokenizer``: where a closing text starts is snapped to a token start)."""
    if template.has_generation_tags:
        text, spans = _render_spans(template, messages, tools, where)
        return text, spans[-1:] if last_only else spans
    text = _render(template, messages, tools, where)
    starts = None
    if tokenizer is not None:  # token starts: the closing text begins at one
        starts = [a for a, _ in _backend(tokenizer).encode(text, add_special_tokens=False).offsets]
    tail = _closing_text(text, messages, template, tools, starts)
    turns = [k for k, m in enumerate(messages) if m.get("role") == "assistant"]
    if last_only:
        turns = turns[-1:]
    spans = []
    for k in turns:
        start = _turn_start(text, messages, k, template, tools, where)
        end = min(_turn_end(text, messages, k, start, template, tools, where, tail),
                  len(text) - len(tail))
        end = start + len(text[start:end].rstrip())
        spans.append((start, end))
    return text, spans


def _closing_text(text: str, messages: Sequence[Mapping], template: ChatTemplate,
                  tools: Any, starts: Sequence[int] | None = None) -> str:
    """What the template writes after the last message only, to close the conversation
    (Phi-3.5's ``eos_token``; nothing for ChatML or Llama 3): the end of ``text`` that a
    rendering with one more (user) message does not have there but also ends with. It
    belongs to no assistant turn, and every shorter rendering ends with it too."""
    try:
        more = template.render([*messages, {"role": "user", "content": _PROBE}], tools=tools)
    except ConfigError:  # a template that refuses the extra turn: nothing measured
        return ""
    n = 0
    for a, b in zip(text, more):
        if a != b:
            break
        n += 1
    if n < len(text) and starts is not None:  # the closing text starts a token: "</s>", not "/s>"
        n = max((a for a in starts if a <= n), default=n)
    tail = text[n:]
    last = str(messages[-1].get("content") or "") if messages else ""
    if not tail or not more.endswith(tail) or _PROBE in tail or (last and last in tail):
        return ""  # nothing closes it, or the extra turn rewrote the last one (not a closing text)
    return tail


# ------------------------------------------------------------------ spans
def _turn_start(text: str, messages: Sequence[Mapping], k: int, template: ChatTemplate,
                tools: Any, where: str) -> int:
    try:
        head = _render(template, messages[:k], tools, where, add_generation_prompt=True,
                       turn=k)
    except ConfigError:
        if k:
            raise
        raise ConfigError(
            f"{_at(where)}messages[0]: the conversation starts with an assistant turn and chat "
            f"template {template.origin} cannot render the empty conversation before it (start "
            "with a system or user message, or use train_on=all)"
        ) from None
    if not text.startswith(head):
        raise ConfigError(
            f"{_at(where)}messages[{k}]: cannot place this assistant turn: chat template "
            f"{template.origin} renders the conversation before it differently from the start "
            "of the whole conversation (use train_on=all, or a template with "
            "{% generation %} blocks)"
        )
    return len(head)


def _turn_end(text: str, messages: Sequence[Mapping], k: int, start: int,
              template: ChatTemplate, tools: Any, where: str, tail: str = "") -> int:
    upto = _render(template, messages[: k + 1], tools, where, turn=k)
    if tail and upto.endswith(tail):  # the closing text is no part of the turn
        upto = upto[: len(upto) - len(tail)]
    if text.startswith(upto) and len(upto) >= start:
        return len(upto)
    # Not prefix-stable (the turn renders differently when it is last): end the turn
    # where a following user turn starts. The user header comes from the difference
    # between one and two probe user turns.
    probe = {"role": "user", "content": _PROBE}
    one = _render(template, [*messages[: k + 1], probe], tools, where, turn=k)
    at = one.rfind(_PROBE)
    header = template._cache.get("user_header")  # measured once per template
    if header is None or not one[:at].endswith(header):
        two = _render(template, [*messages[: k + 1], probe, probe], tools, where, turn=k)
        second = two[len(one):] if two.startswith(one) else ""
        header = second[: second.find(_PROBE)] if _PROBE in second else None
        template._cache["user_header"] = header
    if at >= 0 and header is not None and one[:at].endswith(header):
        end = at - len(header)
        if end >= start and text.startswith(one[:end]):
            return end
    raise ConfigError(
        f"{_at(where)}messages[{k}]: cannot place this assistant turn: chat template "
        f"{template.origin} renders it differently inside the conversation than at its end "
        "(use train_on=last_assistant or all, or a template with {% generation %} blocks)"
    )


def _mask(offsets: Sequence[tuple[int, int]], spans: Sequence[tuple[int, int]]) -> list[bool]:
    mask = [False] * len(offsets)
    s = 0
    for i, (a, b) in enumerate(offsets):
        while s < len(spans) and a >= spans[s][1]:
            s += 1
        if s == len(spans):
            break
        if b > spans[s][0]:
            mask[i] = True
    return mask


# ------------------------------------------------------------------ helpers
def _backend(tokenizer: Any) -> Any:
    return getattr(tokenizer, "tok", tokenizer)


def _at(where: str) -> str:
    return f"{where}: " if where else ""


def _render(template: ChatTemplate, messages: Sequence[Mapping], tools: Any, where: str,
            *, add_generation_prompt: bool = False, turn: int | None = None) -> str:
    try:
        return template.render(messages, add_generation_prompt=add_generation_prompt,
                               tools=tools)
    except ConfigError as exc:
        part = f"messages[{turn}]: " if turn is not None else ""
        raise ConfigError(f"{_at(where)}{part}{exc}") from None


def _render_spans(template: ChatTemplate, messages: Sequence[Mapping], tools: Any,
                  where: str) -> tuple[str, list[tuple[int, int]]]:
    try:
        return template.render_spans(messages, tools=tools)
    except ConfigError as exc:
        raise ConfigError(f"{_at(where)}{exc}") from None
