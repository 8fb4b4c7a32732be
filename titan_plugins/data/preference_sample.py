"""How ``assets/preference_sample.jsonl`` (and ``preference_sample_val.jsonl``) were made:
TRL-style conversational pairs from the shipped chat sample, deterministic.

Each pair's prompt is a chat-sample conversation's system message (if any) and its last
user turn; ``chosen`` is the assistant's answer to it (drawn from the Python reference
section the user asked about), ``rejected`` the last answer of another conversation about
a different topic. The
preference is learnable (stay on the topic of the question), which is what a toy DPO
run should show: the chosen reward rising above the rejected one.

    python -m titan_plugins.data.preference_sample   # rewrites the two files
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from titan_plugins.data.chat_source import ASSETS

__all__ = ["build", "main", "pairs_from"]

SOURCES = {"preference_sample.jsonl": ASSETS / "chat_sample.jsonl",
           "preference_sample_val.jsonl": ASSETS / "chat_sample_val.jsonl"}


def pairs_from(conversations: list[list[dict]], seed: int = 0) -> list[dict]:
    """One pair per conversation whose last turn is the assistant's (see the module docstring)."""
    rng = random.Random(seed)
    usable = [c for c in conversations if c and c[-1]["role"] == "assistant" and len(c) >= 2]
    out = []
    for conv in usable:
        chosen = conv[-1]["content"]
        for _ in range(20):
            other = usable[rng.randrange(len(usable))]
            if other is not conv and other[-1]["content"] != chosen and other[-2]["content"] != conv[-2]["content"]:
                break
        else:
            continue
        system = [m for m in conv[:1] if m["role"] == "system"]
        out.append({"prompt": [*system, conv[-2]],  # the question answered (short pairs: few are cut)
                    "chosen": [{"role": "assistant", "content": chosen}],
                    "rejected": [{"role": "assistant", "content": other[-1]["content"]}]})
    return out


def build() -> dict[str, list[dict]]:
    result = {}
    for name, source in SOURCES.items():
        rows = [json.loads(line)["messages"] for line in source.read_text(encoding="utf-8").splitlines() if line]
        result[name] = pairs_from(rows, seed=len(name))
    return result


def main() -> None:
    for name, rows in build().items():
        path = Path(ASSETS / name)
        path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
        print(f"{path}: {len(rows)} pairs")


if __name__ == "__main__":
    main()
