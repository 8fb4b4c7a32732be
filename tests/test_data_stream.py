"""Streaming sources: lazy start on a ~200 MB corpus, worker sharding, bitwise resume
with loader workers, the weighted mix, every source kind, tokenizer.json round trip."""

from __future__ import annotations

import json
import pickle
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from titan_plugins.config.schema import DataConfig
from titan_plugins.data import build_dataloader, build_tokenizer
from titan_plugins.data.builtin import DATASETS
from titan_plugins.data.stream import check_data_source
from titan_plugins.errors import ConfigError

REGISTRY = {spec.name: spec for spec in DATASETS}
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi".split()


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(DataConfig())


def loader(data, tok, *, rank=0, world=1, batch=4, seq_len=32, seed=0):
    return build_dataloader(data, tok, dp_rank=rank, dp_world=world, local_batch_size=batch,
                            seq_len=seq_len, seed=seed, datasets=REGISTRY)


def take(dl, n):
    return [next(dl) for _ in range(n)]


def _lines(n: int, seed: int, tag: str = "") -> list[str]:
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, len(WORDS), (n, 12))
    return [f"{tag}{i} " + " ".join(WORDS[j] for j in row) + "." for i, row in enumerate(picks)]


@pytest.fixture(scope="session")
def big_corpus(tmp_path_factory):
    """~200 MB of JSONL in 4 files: 2,000 random lines repeated (fast to write)."""
    root = tmp_path_factory.mktemp("big")
    block = "".join(json.dumps({"text": line}) + "\n" for line in _lines(2000, 0)).encode()
    reps = (50 << 20) // len(block) + 1
    for k in range(4):
        with open(root / f"part{k}.jsonl", "wb") as f:
            for _ in range(reps):
                f.write(block)
    return root


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def test_big_corpus_starts_fast_with_flat_memory(big_corpus, tok):
    size = sum(f.stat().st_size for f in big_corpus.iterdir()) / 2**20
    assert size > 190
    before = _rss_mb()
    start = time.perf_counter()
    dl = loader(DataConfig(name="jsonl", path=str(big_corpus), num_workers=0), tok, seq_len=256, batch=8)
    inputs, labels = next(dl)
    first = time.perf_counter() - start
    take(dl, 50)
    grown = _rss_mb() - before
    print(f"corpus {size:.0f} MB: first batch {first:.2f}s, RSS +{grown:.1f} MB")
    assert inputs.shape == (8, 256) and torch.equal(inputs[:, 1:], labels[:, :-1])
    assert first < 5.0
    assert grown < 64  # a few tokenize batches, never the corpus


@pytest.mark.parametrize("workers", [0, 2])
def test_resume_mid_epoch_is_bitwise(tmp_path, tok, workers):
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in _lines(3000, 1)))
    data = DataConfig(name="jsonl", path=str(path), num_workers=workers)
    run = loader(data, tok, rank=1, world=2, seq_len=64)
    take(run, 7)
    state = pickle.loads(pickle.dumps(run.state_dict()))
    expected = take(run, 6)
    resumed = loader(data, tok, rank=1, world=2, seq_len=64)
    resumed.load_state_dict(state)
    got = take(resumed, 6)
    for (x, y), (rx, ry) in zip(expected, got):
        assert torch.equal(x, rx) and torch.equal(y, ry)
    with pytest.raises(ConfigError, match="num_workers"):
        loader(DataConfig(name="jsonl", path=str(path), num_workers=workers + 1), tok,
               rank=1, world=2, seq_len=64).load_state_dict(state)


def test_shards_are_disjoint_across_ranks_and_workers(tmp_path, tok):
    path = tmp_path / "d.txt"
    path.write_text("\n".join(_lines(4000, 2, tag="L")) + "\n")
    seen = []
    for rank in range(2):
        dl = loader(DataConfig(name="text", path=str(path), num_workers=2), tok, rank=rank, world=2,
                    seq_len=64, batch=2)
        text = tok.decode([t for x, _ in take(dl, 20) for t in x.flatten().tolist()])
        seen.append({w for w in text.split() if w.startswith("L") and w[1:].isdigit()})
    assert seen[0] and seen[1] and not (seen[0] & seen[1])


def test_mix_follows_its_weights(tmp_path, tok):
    for name, word in (("a", "apple"), ("b", "banana")):
        (tmp_path / f"{name}.jsonl").write_text(
            "".join(json.dumps({"text": f"{word} {i} " * 30}) + "\n" for i in range(400)))
    mix = [{"name": "jsonl", "path": str(tmp_path / "a.jsonl"), "weight": 3},
           {"name": "jsonl", "path": str(tmp_path / "b.jsonl"), "weight": 1}]
    data = SimpleNamespace(name="mix", mix=mix, path=None, text_field="text", split="train",
                           num_workers=0, prefetch_factor=2)
    dl = loader(data, tok, seq_len=32, batch=20)
    rows = [tok.decode(r.tolist()) for x, _ in take(dl, 40) for r in x]
    apple = sum("apple" in r and "banana" not in r for r in rows) / len(rows)
    assert abs(apple - 0.75) < 0.05  # 800 draws: 3 sigma is ~0.046
    again = loader(data, tok, seq_len=32, batch=20)
    assert torch.equal(next(again)[0], take(loader(data, tok, seq_len=32, batch=20), 1)[0][0])
    state = dl.state_dict()
    expected = take(dl, 3)
    again.load_state_dict(state)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(expected, take(again, 3)))


def test_every_source_kind_yields(tmp_path, tok):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = [f"document {i} about streaming sources. " * 10 for i in range(64)]
    (tmp_path / "t.txt").write_text("\n".join(texts))
    (tmp_path / "j.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    pq.write_table(pa.table({"text": texts}), tmp_path / "p.parquet", row_group_size=16)
    datasets.Dataset.from_dict({"text": texts}).save_to_disk(str(tmp_path / "hf"))
    for name, path in (("text", "t.txt"), ("jsonl", "j.jsonl"), ("parquet", "p.parquet"), ("hf", "hf")):
        data = DataConfig(name=name, path=str(tmp_path / path), num_workers=0)
        inputs, _ = next(loader(data, tok, seq_len=16))
        assert "streaming" in tok.decode(inputs.flatten().tolist()), name


def test_check_data_source_one_line_errors(tmp_path):
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "bin.txt").write_bytes(b"\xff\xfe\x00" * 100)
    (tmp_path / "nofield.jsonl").write_text(json.dumps({"body": "x"}) + "\n")
    cases = [("jsonl", "missing.jsonl", "does not exist"), ("jsonl", "empty.jsonl", "is empty"),
             ("text", "bin.txt", "bin.txt is not UTF-8"),
             ("jsonl", "nofield.jsonl", "data.text_field='text' is not a key of .*nofield.jsonl:1")]
    for name, path, message in cases:
        with pytest.raises(ConfigError, match=message) as err:
            check_data_source(DataConfig(name=name, path=str(tmp_path / path)))
        assert "\n" not in str(err.value)


def test_hf_tokenizer_json_round_trip(tmp_path, tok):
    from tokenizers import Tokenizer as HF
    from tokenizers import models, pre_tokenizers, processors

    # A tokenizer.json as Hugging Face ships one: specials first, BOS from the post-processor.
    hf = HF(models.WordLevel({"<s>": 0, "</s>": 1, "<unk>": 2, "hello": 3, "world": 4}, unk_token="<unk>"))
    hf.pre_tokenizer = pre_tokenizers.Whitespace()
    hf.add_special_tokens(["<s>", "</s>"])
    hf.post_processor = processors.TemplateProcessing(single="<s> $A </s>", special_tokens=[("<s>", 0), ("</s>", 1)])
    (tmp_path / "model").mkdir()
    hf.save(str(tmp_path / "model" / "tokenizer.json"))
    loaded = build_tokenizer(DataConfig(tokenizer=str(tmp_path / "model")))  # a folder works
    assert (loaded.bos_id, loaded.eos_id, loaded.vocab_size) == (0, 1, 5)
    assert loaded.encode("hello world") == [3, 4]
    # The shipped one saves and loads back to the same ids.
    tok.save(tmp_path / "again.json")
    again = build_tokenizer(DataConfig(tokenizer=str(tmp_path / "again.json")))
    text = "The return statement leaves the current function call. naïve 🙂"
    assert again.encode(text) == tok.encode(text) and again.decode(again.encode(text)) == text
    assert again.fingerprint == tok.fingerprint


@pytest.mark.slow
def test_fsdp2_resume_with_workers_is_bitwise(tmp_path):
    """A real 2-rank fsdp2 run on a streamed JSONL with a loader worker per rank:
    stopping at step 2 and resuming gives the uninterrupted run's losses bit for bit."""
    from titan_plugins.train.api import run

    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in _lines(3000, 3)))
    base = ["model=tiny", "training.seq_len=32", "metrics.tensorboard=false", "metrics.console=false",
            "parallelism=fsdp2", "training.local_batch_size=2", "data.name=jsonl", f"data.path={path}",
            "data.num_workers=1", "checkpoint.enabled=true", "checkpoint.interval=2"]

    def go(name, steps):
        r = run([*base, f"training.steps={steps}"], run_dir=tmp_path / name, extra_plugins=["tiny_plugin"],
                timeout=240)
        assert r.returncode == 0, f"{name}: {r.error}\n{r.stderr[-3000:]}"
        return r

    import shutil

    full = go("full", 4)  # saves step-2 and step-4
    shutil.copytree(tmp_path / "full" / "checkpoints" / "step-2", tmp_path / "resumed" / "checkpoints" / "step-2")
    resumed = go("resumed", 4)  # resumes from step-2: steps 3 and 4
    assert resumed.steps[-2:] == [3, 4] and resumed.losses[-2:] == full.losses[2:]
