"""How ``assets/arithmetic.jsonl`` (prompts with exact answers, for ``objective=grpo``)
and ``assets/arithmetic_sft.jsonl`` (the same kind of questions answered, a warm start
for ``data=chat``) were made: deterministic.

Each row asks for a sum or a difference of two numbers below 30 (``"7+12="``) as a
conversational prompt; ``answer`` is the exact result, which the ``accuracy`` reward
compares with the completion's last number. The SFT file holds other questions of the
same kind with the answer as the assistant's reply, so a warm start learns the format
(a number, then the end of the turn) without seeing the RL prompts.

    python -m titan_plugins.data.arithmetic_task   # rewrites the two files
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from titan_plugins.data.chat_source import ASSETS

__all__ = ["build", "main", "questions"]

FILES = {"arithmetic.jsonl": 400, "arithmetic_sft.jsonl": 400}
LIMIT = 30


def questions() -> list[tuple[str, int]]:
    """Every ``("a+b=", a + b)`` and ``("a-b=", a - b)`` with ``0 <= b <= a < LIMIT``."""
    out = []
    for a in range(LIMIT):
        for b in range(a + 1):
            out.append((f"{a}+{b}=", a + b))
            out.append((f"{a}-{b}=", a - b))
    return out


def build(seed: int = 0) -> dict[str, list[dict]]:
    """The RL prompts and the SFT conversations, disjoint questions of each kind."""
    pool = questions()
    random.Random(seed).shuffle(pool)
    rl, sft = pool[: FILES["arithmetic.jsonl"]], pool[FILES["arithmetic.jsonl"]:][: FILES["arithmetic_sft.jsonl"]]
    return {
        "arithmetic.jsonl": [{"prompt": [{"role": "user", "content": q}], "answer": str(a)} for q, a in rl],
        "arithmetic_sft.jsonl": [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": str(a)}]}
                                 for q, a in sft],
    }


def main() -> None:
    for name, rows in build().items():
        path = Path(ASSETS / name)
        path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
        print(f"{path}: {len(rows)} rows")


if __name__ == "__main__":
    main()
