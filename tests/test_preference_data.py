"""data.name=preference (titan_plugins/data/preference_source.py): TRL's row
layouts in JSONL, Parquet and a save_to_disk folder; bad rows as one line naming the
file and row; truncation counted; the global batch independent of the layout; resume."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from titan_plugins.data.chat_source import CHAT_TOKENIZER
from titan_plugins.data.preference_source import (
    PreferenceDataset,
    check_preference,
    check_preference_sample,
)
from titan_plugins.data.tokenizer import Tokenizer
from titan_plugins.errors import ConfigError
from titan_plugins.loss.token_loss import IGNORE_INDEX

TOK = Tokenizer.load(CHAT_TOKENIZER)


def _pair(i: int) -> dict:
    return {"prompt": [{"role": "user", "content": f"Question {i}: what is a list?"}],
            "chosen": [{"role": "assistant", "content": f"A mutable sequence ({i})."}],
            "rejected": [{"role": "assistant", "content": f"A kind of fish ({i})."}]}


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _cfg(path, **pref):
    return SimpleNamespace(name="preference", path=path, split="train", tokenizer=None, preference=pref or None)


def _dataset(path, *, dp_rank=0, dp_world=1, batch=4, accum=1, seq_len=64, **pref):
    ds = PreferenceDataset(_cfg(path, **pref), TOK, dp_rank=dp_rank, dp_world=dp_world, seq_len=seq_len, seed=0)
    ds.set_layout(batch, accum)
    return ds


def _batches(ds, n):
    it, out = iter(ds), []
    for _ in range(n):
        rows = [next(it) for _ in range(ds.block)]
        out.append((torch.stack([r[0] for r in rows]), torch.stack([r[1] for r in rows])))
    return out


def test_a_batch_is_chosen_rows_then_rejected_rows_and_only_completions_count(tmp_path):
    path = _write(tmp_path / "p.jsonl", [_pair(i) for i in range(6)])
    (x, y), = _batches(_dataset(path), 1)
    texts = [TOK.decode([t for t in row.tolist() if t != IGNORE_INDEX]) for row in y]
    assert "mutable" in texts[0] and "mutable" in texts[1] and "fish" in texts[2] and "fish" in texts[3]
    assert all(t.endswith("<|im_end|>\n") for t in texts)  # TRL's completion: reply, end of turn, newline
    prompt_of = [TOK.decode(row[: int((lab == IGNORE_INDEX).long().argmin())].tolist()) for row, lab in zip(x, y)]
    assert prompt_of[0] == prompt_of[2] and prompt_of[1] == prompt_of[3]  # a pair shares its prompt


def test_implicit_prompt_plain_text_parquet_and_hf_folders_read_the_same_pairs(tmp_path):
    rows = [_pair(i) for i in range(4)]
    implicit = [{"chosen": r["prompt"] + r["chosen"], "rejected": r["prompt"] + r["rejected"]} for r in rows]
    plain = [{"prompt": r["prompt"][0]["content"], "chosen": r["chosen"][0]["content"],
              "rejected": r["rejected"][0]["content"]} for r in rows]
    want = _batches(_dataset(_write(tmp_path / "a.jsonl", rows)), 2)
    for name, data in (("implicit", implicit), ("plain", plain)):
        got = _batches(_dataset(_write(tmp_path / f"{name}.jsonl", data)), 2)
        assert all(torch.equal(a, b) for wa, ga in zip(want, got) for a, b in zip(wa, ga)), name
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "p.parquet")
    got = _batches(_dataset(str(tmp_path / "p.parquet")), 2)
    assert all(torch.equal(a, b) for wa, ga in zip(want, got) for a, b in zip(wa, ga))
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "hf"))
    got = _batches(_dataset(str(tmp_path / "hf")), 2)
    assert all(torch.equal(a, b) for wa, ga in zip(want, got) for a, b in zip(wa, ga))


@pytest.mark.parametrize("row, message", [
    ({"prompt": "q", "chosen": "a"}, "p.jsonl:2: field 'rejected' is missing or empty"),
    ({"prompt": "q", "chosen": "a", "rejected": [{"role": "assistant", "content": "  "}]},
     "p.jsonl:2: field 'rejected': the completion is empty"),
    ({"prompt": "q", "chosen": "same", "rejected": "same"}, "p.jsonl:2: 'chosen' and 'rejected' are identical"),
    ({"chosen": [{"role": "user", "content": "x"}], "rejected": [{"role": "user", "content": "y"}]},
     "p.jsonl:2: field 'prompt' is missing and 'chosen' / 'rejected' share no prompt"),
    ({"prompt": "q", "chosen": [{"role": "user", "content": "x"}], "rejected": "b"},
     "p.jsonl:2: field 'chosen': the completion must be one assistant message"),
])
def test_a_bad_row_is_one_line_naming_the_file_and_row_before_launch(tmp_path, row, message):
    path = _write(tmp_path / "p.jsonl", [_pair(0), row])
    with pytest.raises(ConfigError) as err:
        check_preference(_cfg(path), seq_len=64)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_truncation_rules_are_applied_and_counted(tmp_path):
    long = _pair(0)
    long["prompt"][0]["content"] = "word " * 200
    long["chosen"][0]["content"] = "yes " * 100
    path = _write(tmp_path / "p.jsonl", [long, _pair(1)])
    with pytest.raises(ConfigError, match=r"p.jsonl:1: the pair is \d+ tokens, over training.seq_len=64"):
        check_preference(_cfg(path, overlong="error"), seq_len=64)
    ds = _dataset(path, max_prompt_length=30, max_completion_length=16, seq_len=64)  # the short pair fits
    (x, y), = _batches(ds, 1)
    counts = ds.stats()
    assert counts["pairs"] == 2 and counts["prompt_truncated"] == 1 and counts["completion_truncated"] == 1
    long_row = 0 if (y[0] != IGNORE_INDEX).sum() == 16 else 1  # the long pair's chosen row
    assert (y[long_row] != IGNORE_INDEX).sum() == 16
    assert (x[long_row] != TOK.pad_id).sum() <= 30 + 16 - 1  # prompt cut to 30, completion to 16
    dropped = _dataset(path, overlong="drop", seq_len=64)
    _batches(dropped, 1)
    assert dropped.stats()["pairs_dropped"] >= 1


def test_the_global_batch_is_the_same_at_any_layout_and_resumes(tmp_path):
    path = _write(tmp_path / "p.jsonl", [_pair(i) for i in range(10)])

    def pairs(batches):  # the set of (chosen, rejected) rows of a step
        out = set()
        for x, _ in batches:
            n = x.shape[0] // 2
            out |= {(tuple(x[i].tolist()), tuple(x[i + n].tolist())) for i in range(n)}
        return out

    one = _batches(_dataset(path, batch=4), 3)
    for step in range(3):
        ranks = [_batches(_dataset(path, dp_rank=r, dp_world=2, batch=2, accum=1), 3)[step] for r in (0, 1)]
        accum = _batches(_dataset(path, batch=2, accum=2), 6)[2 * step: 2 * step + 2]
        assert pairs([one[step]]) == pairs(ranks) == pairs(accum), step
    ds = _dataset(path, batch=4)
    _batches(ds, 2)
    again = _dataset(path, batch=4)
    again.load_state_dict(ds.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(_batches(again, 1)[0], one[2]))


def test_the_shipped_sample_is_well_formed():
    check_preference_sample(SimpleNamespace(name="preference_sample", path=None, split="train",
                                            tokenizer=None, preference=None), seq_len=256)
    with pytest.raises(ConfigError, match="data.split='test': the preference sample has the splits"):
        check_preference_sample(SimpleNamespace(name="preference_sample", path=None, split="test",
                                                tokenizer=None, preference=None))
