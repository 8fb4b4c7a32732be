"""Write the shipped synthetic chat sample from the shipped corpus.

    python -m titan_plugins.chat.make_sample            # rewrites the two files below

``data/assets/chat_sample.jsonl`` (``TRAIN`` conversations) and
``chat_sample_val.jsonl`` (``VAL``, held out: other topics' answers are not in it
but the same question/answer patterns are), one ``{"messages": [...]}`` per line. Each
conversation is about one topic of the corpus (the Python Language Reference): an
optional system prompt, a question whose answer is a run of the topic's paragraphs
(lengths spread from one sentence to a few paragraphs), and up to three follow-ups
(an example from the text, a one-sentence summary, a yes/no check, a related topic).
Deterministic: the same corpus gives the same bytes.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

from titan_plugins.data.tokenizer import ASSETS

TRAIN, VAL = 300, 40
OUT = ASSETS / "chat_sample.jsonl"
OUT_VAL = ASSETS / "chat_sample_val.jsonl"
MAX_ANSWER = 900  # characters per answer, so the files stay small

SYSTEMS = [
    None, None,
    "You are a helpful assistant who explains Python precisely.",
    "You are a concise tutor for the Python Language Reference. Quote it when you can.",
    "Answer questions about Python's syntax and semantics. Keep answers short.",
]
ASK = [
    "What does the Python reference say about {t}?",
    "Can you explain {t} in Python?",
    "How does {t} work?",
    "I'm reading about {t}. What should I know?",
    "Explain {t}, please.",
]
EXAMPLE = ["Can you show an example?", "Is there an example in the reference?"]
SUMMARY = ["Summarize that in one sentence.", "Give me the short version."]
CHECK = ["Is {t} a statement or an expression?", "Does {t} have special syntax?"]


def _paragraphs(text: str) -> list[str]:
    parts = [p.strip() for p in re.split(r"\n\s*\n", text)]
    return [p for p in parts if p and not set(p) <= set("*=-~^ ")]


def _prose(paras: list[str]) -> list[str]:
    return [p for p in paras if not p.startswith(("   ", ">>>")) and "::=" not in p]


def _answer(paras: list[str], rng: random.Random) -> str:
    n = min(len(paras), max(1, int(rng.lognormvariate(0.3, 0.7))))
    start = rng.randrange(0, max(1, len(paras) - n + 1))
    text = "\n\n".join(paras[start : start + n])
    if len(text) > MAX_ANSWER:
        cut = text.rfind(". ", 0, MAX_ANSWER)
        text = text[: cut + 1] if cut > 0 else text[:MAX_ANSWER]
    return text


def _first_sentence(text: str) -> str:
    m = re.search(r"(.+?[.!?])(\s|$)", text.replace("\n", " "), re.S)
    return (m.group(1) if m else text)[:300]


def _conversation(title: str, text: str, others: list[str], rng: random.Random) -> dict:
    paras = _paragraphs(text)
    prose = _prose(paras) or paras
    code = [p for p in paras if p.startswith("   ")]
    messages = []
    system = rng.choice(SYSTEMS)
    if system:
        messages.append({"role": "system", "content": system})
    topic = f"`{title}`" if rng.random() < 0.5 else title.replace("-", " ")
    messages.append({"role": "user", "content": rng.choice(ASK).format(t=topic)})
    answer = _answer(prose, rng)
    messages.append({"role": "assistant", "content": answer})
    for _ in range(rng.choice([0, 0, 1, 1, 2, 3])):
        kind = rng.choice(["example", "summary", "check", "related"])
        if kind == "example" and code:
            messages.append({"role": "user", "content": rng.choice(EXAMPLE)})
            snippet = "\n".join(line[3:] for line in rng.choice(code).splitlines())
            messages.append({"role": "assistant",
                             "content": f"From the reference:\n\n```\n{snippet[:600]}\n```"})
        elif kind == "summary":
            messages.append({"role": "user", "content": rng.choice(SUMMARY)})
            messages.append({"role": "assistant", "content": _first_sentence(answer)})
        elif kind == "check":
            messages.append({"role": "user", "content": rng.choice(CHECK).format(t=topic)})
            is_stmt = "statement" in text[:400].lower()
            messages.append({"role": "assistant", "content": (
                "It is described as a statement." if is_stmt else
                "The reference does not describe it as a statement.")})
        else:
            other = rng.choice(others)
            messages.append({"role": "user", "content": f"How is that related to {other}?"})
            messages.append({"role": "assistant", "content": (
                f"They are separate topics of the reference; {title} and {other} are "
                "documented in their own sections.")})
    return {"messages": messages}


def build(corpus: Path = ASSETS / "corpus.jsonl") -> tuple[list[dict], list[dict]]:
    docs = [json.loads(line) for line in corpus.read_text(encoding="utf-8").splitlines()]
    docs = [d for d in docs if _paragraphs(d["text"])]
    titles = [d["title"] for d in docs]
    rng = random.Random(0)
    held = set(rng.sample(titles, k=max(1, len(titles) // 10)))
    train_docs = [d for d in docs if d["title"] not in held]
    val_docs = [d for d in docs if d["title"] in held]
    train = [_conversation(d["title"], d["text"], titles, rng)
             for d in (rng.choice(train_docs) for _ in range(TRAIN))]
    val = [_conversation(d["title"], d["text"], titles, rng)
           for d in (rng.choice(val_docs) for _ in range(VAL))]
    return train, val


def _write(rows: list[dict], path: Path) -> None:
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
    path.write_text(text, encoding="utf-8")


def main() -> None:
    train, val = build()
    _write(train, OUT)
    _write(val, OUT_VAL)
    for path, rows in ((OUT, train), (OUT_VAL, val)):
        turns = sum(sum(m["role"] == "assistant" for m in r["messages"]) for r in rows)
        print(f"{path.name}: {len(rows)} conversations, {turns} assistant turns, "
              f"{path.stat().st_size:,} bytes")


if __name__ == "__main__":
    main()
