"""The shipped synthetic chat sample: rebuilt by its script byte for byte, valid, varied."""

from __future__ import annotations

import json

from titan_plugins.chat import (
    ChatFields,
    encode_conversation,
    load_chat_template,
    make_sample,
    to_messages,
)
from titan_plugins.data.tokenizer import ASSETS, Tokenizer


def test_sample_is_what_the_script_writes():
    train, val = make_sample.build()
    for rows, path in ((train, make_sample.OUT), (val, make_sample.OUT_VAL)):
        expected = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
        assert path.read_text(encoding="utf-8") == expected, f"rerun make_sample ({path.name})"
    assert make_sample.OUT.stat().st_size + make_sample.OUT_VAL.stat().st_size < 300_000
    # held-out topics: no validation answer appears in the training file
    train_answers = {m["content"] for r in train for m in r["messages"][:3]
                     if m["role"] == "assistant"}
    first = [next(m for m in r["messages"] if m["role"] == "assistant") for r in val]
    assert sum(m["content"] in train_answers for m in first) <= len(val) // 10


def test_sample_rows_encode_with_a_spread_of_lengths():
    tok = Tokenizer.load(ASSETS / "chat_tokenizer")
    template = load_chat_template("chatml", None)
    rows = [json.loads(line) for line in make_sample.OUT.read_text().splitlines()]
    assert len(rows) == make_sample.TRAIN
    lengths, turns, systems = [], [], 0
    for i, row in enumerate(rows):
        messages = to_messages(row, ChatFields(), where=f"chat_sample.jsonl:{i + 1}")
        ids, mask = encode_conversation(messages, template, tok)
        assert any(mask) and not all(mask)
        lengths.append(len(ids))
        turns.append(sum(m["role"] == "assistant" for m in messages))
        systems += messages[0]["role"] == "system"
    lengths.sort()
    assert lengths[0] < 80 and lengths[-1] > 300 and lengths[len(lengths) // 2] > 120
    assert max(turns) >= 3 and sum(t > 1 for t in turns) > len(rows) // 3
    assert 0.3 * len(rows) < systems < 0.9 * len(rows)
