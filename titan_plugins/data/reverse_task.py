"""How ``assets/reverse.jsonl`` (prompts with exact answers, for ``objective=grpo``)
and ``assets/reverse_sft.jsonl`` (other questions of the same kind answered, a warm
start for ``data=chat``) were made: deterministic.

Each row asks to reverse five space-separated letters from ``a`` to ``j``
(``"reverse: c a j j b"``); ``answer`` is the reversed sequence (``"b j j a c"``), which
the ``accuracy`` reward compares with the completion's text exactly. Each letter is one
token of the shipped ChatML tokenizer (``c`` first, ``Ġa`` after a space), so an answer is
five tokens and the end of the turn. Unlike two-digit arithmetic, the skill generalises in
a ~1M-parameter model after a short SFT: the warm start gets most letters right but rarely
all five when sampled at temperature 1, which is what GRPO sharpens. The SFT questions and
the RL prompts are disjoint.

    python -m titan_plugins.data.reverse_task   # rewrites the two files
"""

from __future__ import annotations

import itertools
import random

from titan_plugins.data.arithmetic_task import task_files, write_assets

__all__ = ["build", "main", "questions"]

FILES = {"reverse.jsonl": 400, "reverse_sft.jsonl": 2000}
LETTERS = "abcdefghij"
LENGTH = 5


def questions() -> list[tuple[str, str]]:
    """Every ``("reverse: x1 ... x5", "x5 ... x1")`` over ``LETTERS``, in order."""
    return [(f"reverse: {' '.join(w)}", " ".join(reversed(w))) for w in itertools.product(LETTERS, repeat=LENGTH)]


def build(seed: int = 0) -> dict[str, list[dict]]:
    """The RL prompts and the SFT conversations: disjoint random questions."""
    pool = random.Random(seed).sample(questions(), sum(FILES.values()))
    rl, sft = pool[: FILES["reverse.jsonl"]], pool[FILES["reverse.jsonl"]:]
    return task_files("reverse.jsonl", "reverse_sft.jsonl", rl, sft)


def main() -> None:
    write_assets(build())


if __name__ == "__main__":
    main()
