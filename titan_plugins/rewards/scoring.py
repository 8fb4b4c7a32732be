"""Calling the reward functions on a batch of completions, as TRL's GRPOTrainer calls
them: keyword arguments ``prompts``, ``completions``, ``completion_ids`` and every other
column of the prompts data by name (one value per completion); ``None`` for a completion
skips that function there (NaN in the table, left out of its mean and of the weighted
sum). A function that raises is named with the row it raised on (found by calling it on
one completion at a time) and stops the run in one line; so does one that returns the
wrong number of values or something that is not a number."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from titan_plugins.errors import TitanError

__all__ = ["RewardError", "score"]


class RewardError(TitanError):
    """A reward function failed on the data: one line naming it and the row."""


def _short(completion: Any) -> str:
    text = completion if isinstance(completion, str) else str((completion or [{}])[-1].get("content", completion))
    return repr(text if len(text) <= 60 else text[:57] + "...")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__


def _call(fn: Callable[..., Any], prompts: Sequence[Any], completions: Sequence[Any],
          completion_ids: Sequence[list[int]], columns: Mapping[str, Sequence[Any]]) -> Any:
    return fn(prompts=list(prompts), completions=list(completions), completion_ids=list(completion_ids),
              **{k: list(v) for k, v in columns.items()})


def _culprit(fn: Callable[..., Any], prompts, completions, completion_ids, columns) -> int | None:
    """The first row the function raises on alone (None: it fails only on the batch)."""
    for i in range(len(completions)):
        try:
            _call(fn, prompts[i:i + 1], completions[i:i + 1], completion_ids[i:i + 1],
                  {k: v[i:i + 1] for k, v in columns.items()})
        except Exception:  # noqa: BLE001 - any failure of the user's function is the one we look for
            return i
    return None


def _value(name: str, value: Any, where: str) -> float:
    if value is None:
        return math.nan
    if isinstance(value, bool) or not isinstance(value, int | float):
        try:
            return float(value)  # numpy / torch scalars
        except (TypeError, ValueError):
            raise RewardError(f"reward {name!r} returned {value!r} for {where}: a reward is a number or None") from None
    return float(value)


def score(rewards: Sequence[tuple[str, Callable[..., Any]]], *, prompts: Sequence[Any], completions: Sequence[Any],
          completion_ids: Sequence[list[int]], columns: Mapping[str, Sequence[Any]], wheres: Sequence[str],
          given: Mapping[str, Sequence[Any]] | None = None) -> list[list[float]]:
    """One list per reward function of one float per completion (NaN where it returned
    None). ``given`` holds values already known (``rollout=file``'s rewards) by name:
    those functions are not called. ``wheres`` names each completion's source row."""
    n = len(completions)
    table = []
    for name, fn in rewards:
        if given is not None and name in given:
            values = list(given[name])
        else:
            try:
                values = _call(fn, prompts, completions, completion_ids, columns)
            except Exception as exc:  # noqa: BLE001 - the user's function: one line, then stop
                i = _culprit(fn, prompts, completions, completion_ids, columns)
                where = (f"{wheres[i]} (completion {_short(completions[i])})" if i is not None
                         else f"a batch of {n} completions")
                raise RewardError(f"reward {name!r} raised on {where}: {_first_line(exc)}") from None
        if not isinstance(values, Sequence) or isinstance(values, str) or len(values) != n:
            got = len(values) if isinstance(values, Sequence) and not isinstance(values, str) else type(values).__name__
            raise RewardError(f"reward {name!r} returned {got} rewards for {n} completions (one per completion, "
                              "None to skip one)")
        table.append([_value(name, v, wheres[i]) for i, v in enumerate(values)])
    return table
