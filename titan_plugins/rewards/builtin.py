"""The core's rewards, each with TRL's signature (``prompts, completions,
completion_ids, **columns -> list[float | None]``). A completion is a string (plain
prompts) or ``[{"role": "assistant", "content": text}]`` (conversational prompts), as
TRL hands them over."""

from __future__ import annotations

import math
import re
from typing import Any

__all__ = ["accuracy", "answer_text", "format", "length"]

THINK_ANSWER = r"<think>.*?</think>\s*<answer>.*?</answer>"
_NUMBER = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?")
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def _text(completion: Any) -> str:
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list) and completion and isinstance(completion[-1], dict):
        return str(completion[-1].get("content", ""))
    raise TypeError(f"a completion is a string or a list of messages, not {type(completion).__name__}")


def _number(text: str) -> float | None:
    try:
        return float(text.replace(",", "").strip())
    except ValueError:
        return None


def answer_text(completion: Any) -> str:
    """What a completion answers: the last ``<answer>...</answer>`` where there is one,
    else the whole text, stripped."""
    text = _text(completion)
    tagged = _ANSWER_TAG.findall(text)
    return (tagged[-1] if tagged else text).strip()


def _math_verify(gold: str, prediction: str) -> float | None:
    """math-verify's verdict where the package is installed and parses the gold answer."""
    try:
        from math_verify import parse, verify
    except ImportError:
        return None
    parsed = parse(gold)
    if not parsed:
        return None
    return float(verify(parsed, parse(prediction)))


def accuracy(prompts: list[Any], completions: list[Any], completion_ids: list[list[int]],
             answer: list[Any] | None = None, **kwargs: Any) -> list[float | None]:
    """1.0 when the completion's answer equals the row's ``answer`` column, else 0.0;
    None (skipped) where the row has no answer. A numeric answer is compared as a number
    with the completion's last number (``<answer>`` tags first); anything else by exact
    text, or by math-verify where it is installed and parses the answer."""
    if answer is None:
        raise ValueError("needs an 'answer' column in the prompts data (the expected answer of each prompt)")
    out: list[float | None] = []
    for completion, gold in zip(completions, answer, strict=True):
        if gold is None:
            out.append(None)
            continue
        prediction = answer_text(completion)
        gold_text = str(gold).strip()
        want = _number(gold_text)
        if want is not None:
            found = _NUMBER.findall(prediction)
            got = _number(found[-1]) if found else None
            out.append(float(got is not None and math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-12)))
            continue
        verdict = _math_verify(gold_text, prediction)
        out.append(verdict if verdict is not None else float(prediction == gold_text))
    return out


def format(prompts: list[Any], completions: list[Any], completion_ids: list[list[int]],
           pattern: str = THINK_ANSWER, **kwargs: Any) -> list[float]:
    """1.0 when the whole completion matches ``pattern`` (a regex, ``.`` matching newlines
    too; option ``objective.reward_options.format.pattern``), else 0.0."""
    regex = re.compile(pattern, re.DOTALL)
    return [1.0 if regex.fullmatch(_text(c).strip()) else 0.0 for c in completions]


def length(prompts: list[Any], completions: list[Any], completion_ids: list[list[int]], *,
           max_completion_len: int, soft_punish_cache: int | None = None, **kwargs: Any) -> list[float]:
    """DAPO's soft overlong punishment (TRL's ``get_soft_overlong_punishment``): 0 for a
    completion of at most ``max_completion_len - soft_punish_cache`` tokens, falling
    linearly to -1 at ``max_completion_len``, -1 beyond. ``max_completion_len`` defaults
    to ``objective.max_completion_length``, ``soft_punish_cache`` to a quarter of it."""
    cache = max(1, max_completion_len // 4) if soft_punish_cache is None else int(soft_punish_cache)
    out = []
    for ids in completion_ids:
        n = len(ids)
        if n <= max_completion_len - cache:
            out.append(0.0)
        elif n <= max_completion_len:
            out.append((max_completion_len - cache - n) / cache)
        else:
            out.append(-1.0)
    return out
