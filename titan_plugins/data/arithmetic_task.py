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

__all__ = ["build", "main", "questions", "task_files", "write_assets"]

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


def task_files(rl_name: str, sft_name: str, rl: list[tuple[str, object]],
               sft: list[tuple[str, object]]) -> dict[str, list[dict]]:
    """A verifiable task's two files: ``rl`` as prompt rows with their ``answer``, ``sft``
    as answered conversations (the warm start). Shared by the shipped tasks."""
    return {
        rl_name: [{"prompt": [{"role": "user", "content": q}], "answer": str(a)} for q, a in rl],
        sft_name: [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": str(a)}]}
                   for q, a in sft],
    }


def write_assets(files: dict[str, list[dict]]) -> None:
    for name, rows in files.items():
        path = Path(ASSETS / name)
        path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
        print(f"{path}: {len(rows)} rows")


def build(seed: int = 0) -> dict[str, list[dict]]:
    """The RL prompts and the SFT conversations, disjoint questions of each kind."""
    pool = questions()
    random.Random(seed).shuffle(pool)
    rl, sft = pool[: FILES["arithmetic.jsonl"]], pool[FILES["arithmetic.jsonl"]:][: FILES["arithmetic_sft.jsonl"]]
    return task_files("arithmetic.jsonl", "arithmetic_sft.jsonl", rl, sft)


def main() -> None:
    write_assets(build())


if __name__ == "__main__":
    main()
