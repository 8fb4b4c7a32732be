"""The core's one "did you mean" helper, for every message that names an unknown
word (a model, a preset, a schema key, a hook, a dataset)."""

from __future__ import annotations

import difflib
from collections.abc import Iterable

# difflib's ratio: 0.5 still catches a swapped pair in a short name ("tyo" -> "toy").
CUTOFF = 0.5


def closest(word: str, choices: Iterable[str]) -> str | None:
    """The choice closest to ``word``, else the first choice (sorted) that starts
    with it or contains it ("fp" -> "fp32"); ``None`` when nothing is close."""
    options = [str(c) for c in choices]
    close = difflib.get_close_matches(word, options, n=1, cutoff=CUTOFF)
    if close:
        return close[0]
    if not word:
        return None
    return next((c for c in sorted(options) if c.startswith(word) or word in c), None)


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """``"; did you mean 'x'?"`` to append to a message, or ``""``."""
    match = closest(word, choices)
    return f"; did you mean {match!r}?" if match is not None else ""
