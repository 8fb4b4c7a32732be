"""Training data: tokenizer, packing, sharding, resume, the built-in datasets."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from titan_plugins.config.schema import DataConfig
from titan_plugins.data import (
    PackedTokenDataset,
    SyntheticTokenDataset,
    Tokenizer,
    build_dataloader,
    build_tokenizer,
    encode_documents,
    train_bpe,
)
from titan_plugins.data.builtin import DATASETS
from titan_plugins.data.sources import CORPUS, corpus_tokens, read_jsonl
from titan_plugins.errors import ConfigError

REGISTRY = {spec.name: spec for spec in DATASETS}


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    # Token caches of these tests go to a fresh directory, never the user's.
    monkeypatch.setenv("TITAN_PLUGINS_CACHE", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return build_tokenizer(DataConfig())


def loader(data=None, tokenizer=None, *, rank=0, world=1, batch=4, seq_len=32, seed=0):
    data = data or DataConfig()
    tokenizer = tokenizer or build_tokenizer(data)
    return build_dataloader(
        data,
        tokenizer,
        dp_rank=rank,
        dp_world=world,
        local_batch_size=batch,
        seq_len=seq_len,
        seed=seed,
        datasets=REGISTRY,
    )


def take(dl, n):
    return [next(dl) for _ in range(n)]


def rows(batches):
    return [tuple(x.tolist()) for inputs, _ in batches for x in inputs]


# ---------------------------------------------------------------- tokenizer
@pytest.mark.parametrize(
    "text",
    [
        "",
        "The assignment statement evaluates the expression list.",
        "def __init__(self):\n\treturn {'a': 1_000}  # done\n\n\n",
        "naïve café “quotes” — 日本語 🙂 ß\r\n  trailing   ",
    ],
)
def test_tokenizer_round_trips(tok, text):
    ids = tok.encode(text)
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text


def test_default_tokenizer_vocab_and_specials(tok):
    assert tok.vocab_size == 2048  # the first-party debug models' vocab
    assert {tok.bos_id, tok.eos_id} == {2046, 2047}
    assert tok.decode([tok.bos_id, tok.eos_id]) == "<|bos|><|eos|>"
    # BPE compresses English: well under one token per character.
    text = "The return statement leaves the current function call."
    assert len(tok.encode(text)) < len(text) / 3


def test_shipped_tokens_match_corpus(tok):
    docs = read_jsonl(CORPUS, "text")
    assert 300_000 < sum(map(len, docs)) < 1_500_000
    np.testing.assert_array_equal(corpus_tokens(tok), encode_documents(docs, tok))


def test_train_bpe_is_deterministic_and_loads_back(tmp_path):
    texts = ["the cat sat on the mat", "the dog sat on the log"] * 5
    a, b = train_bpe(texts, 270), train_bpe(texts, 270)
    assert a.merges == b.merges and a.vocab_size == 270
    path = tmp_path / "tokenizer.json"
    a.save(path)
    loaded = build_tokenizer(DataConfig(tokenizer=str(path)))
    assert loaded.merges == a.merges and loaded.fingerprint == a.fingerprint
    assert loaded.decode(loaded.encode("the cat sat")) == "the cat sat"
    assert len(loaded.encode("the cat sat")) < len("the cat sat")


def test_bad_tokenizer_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="data.tokenizer=.*does not exist"):
        build_tokenizer(DataConfig(tokenizer=str(tmp_path / "nope.json")))
    (tmp_path / "hf.json").write_text(json.dumps({"model": {"type": "BPE"}}))
    with pytest.raises(ConfigError, match="not a Hugging Face tokenizer.json"):
        build_tokenizer(DataConfig(tokenizer=str(tmp_path / "hf.json")))


def test_builtin_with_another_tokenizer(tmp_path):
    small = train_bpe(read_jsonl(CORPUS, "text")[:3], 300)
    small.save(tmp_path / "small.json")
    data = DataConfig(tokenizer=str(tmp_path / "small.json"))
    tokenizer = build_tokenizer(data)
    inputs, _ = next(loader(data, tokenizer))
    assert int(inputs.max()) < 300


# ---------------------------------------------------------------- batches
def test_batches_shape_dtype_and_shifted_labels(tok):
    tokens = corpus_tokens(tok)
    for inputs, labels in take(loader(seq_len=64, batch=3), 5):
        assert inputs.shape == labels.shape == (3, 64)
        assert inputs.dtype == labels.dtype == torch.int64
        assert torch.equal(inputs[:, 1:], labels[:, :-1])
        for x, y in zip(inputs, labels):  # each row is a window of the packed stream
            window = torch.cat([x, y[-1:]]).numpy()
            starts = np.flatnonzero(tokens[:-64:64] == window[0]) * 64
            assert any((tokens[s : s + 65] == window).all() for s in starts)


def test_loss_inputs_look_like_text(tok):
    inputs, _ = next(loader(seq_len=128, batch=1))
    text = tok.decode(inputs[0].tolist())
    assert sum(c.isalpha() or c.isspace() for c in text) > 0.6 * len(text)


def test_dp_shards_are_disjoint_and_cover_an_epoch():
    tokens = np.arange(12 * 8 + 1, dtype=np.uint16)  # 12 windows of seq_len 8
    world = 3
    seen = []
    for rank in range(world):
        stream = iter(PackedTokenDataset(tokens, seq_len=8, dp_rank=rank, dp_world=world, seed=1))
        seen.append({int(next(stream)[0][0]) // 8 for _ in range(4)})
    assert all(not (seen[a] & seen[b]) for a in range(3) for b in range(a + 1, 3))
    assert set.union(*seen) == set(range(12))


def test_dp_step_sees_the_single_rank_batch():
    # 2 ranks at batch 4 consume what 1 rank at batch 8 does, step for step.
    single = take(loader(batch=8), 3)
    ranks = [take(loader(rank=r, world=2, batch=4), 3) for r in range(2)]
    for step in range(3):
        # Rank r holds exactly rows r*4 .. r*4+3 of the single rank's batch, in order.
        assert rows([ranks[0][step], ranks[1][step]]) == rows([single[step]])


def test_dp_rank_batch_is_the_accumulation_microbatch():
    # FSDP on 2 ranks vs 1 rank accumulating 2 microbatches: same sequences per microbatch,
    # which is what makes the bitwise comparison of the two possible.
    single = take(loader(batch=4), 4)  # microbatches 0,1 of step 0, then of step 1
    ranks = [take(loader(rank=r, world=2, batch=4), 2) for r in range(2)]
    for step in range(2):
        for r in range(2):
            assert rows([ranks[r][step]]) == rows([single[2 * step + r]])


def test_epochs_wrap_and_reshuffle():
    tokens = np.arange(10 * 4 + 1, dtype=np.uint16)  # 10 windows
    stream = iter(PackedTokenDataset(tokens, seq_len=4, dp_rank=0, dp_world=1, seed=0))
    order = [int(next(stream)[0][0]) // 4 for _ in range(30)]
    epochs = [order[i : i + 10] for i in (0, 10, 20)]
    assert all(sorted(e) == list(range(10)) for e in epochs)
    assert epochs[0] != epochs[1] != epochs[2]


def test_seed_changes_the_order():
    a, b = next(loader(seed=0)), next(loader(seed=1))
    assert not torch.equal(a[0], b[0])
    assert torch.equal(next(loader(seed=0))[0], a[0])


# ---------------------------------------------------------------- resume
@pytest.mark.parametrize("name", ["builtin", "synthetic"])
def test_resume_gives_the_same_next_batches(name):
    data = DataConfig(name=name)
    run = loader(data, rank=1, world=2, seq_len=256)  # 256 x 2 ranks: wraps an epoch soon
    take(run, 130)
    state = pickle.loads(pickle.dumps(run.state_dict()))  # plain ints and strings
    expected = take(run, 5)
    resumed = loader(data, rank=1, world=2, seq_len=256)
    resumed.load_state_dict(state)
    for (x, y), (rx, ry) in zip(expected, take(resumed, 5)):
        assert torch.equal(x, rx) and torch.equal(y, ry)


def test_resume_at_another_dp_degree_continues_the_run():
    two = [loader(rank=r, world=2, batch=2) for r in range(2)]
    for dl in two:
        take(dl, 3)
    state = two[0].state_dict()
    expected = rows([next(two[0]), next(two[1])])
    one = loader(batch=4)
    one.load_state_dict(state)
    assert sorted(rows([next(one)])) == sorted(expected)


def test_resume_with_other_data_is_a_config_error():
    state = loader(seq_len=32).state_dict()
    with pytest.raises(ConfigError, match="seq_len=32 but this run has 64"):
        loader(seq_len=64).load_state_dict(state)


# ---------------------------------------------------------------- synthetic
def test_synthetic_is_deterministic_per_seed_and_rank():
    data = DataConfig(name="synthetic")
    a, b = take(loader(data, seed=3), 2), take(loader(data, seed=3), 2)
    assert all(torch.equal(x[0], y[0]) for x, y in zip(a, b))
    assert not torch.equal(a[0][0], next(loader(data, seed=4))[0])
    r0, r1 = next(loader(data, rank=0, world=2)), next(loader(data, rank=1, world=2))
    assert not torch.equal(r0[0], r1[0])
    assert 0 <= int(a[0][0].min()) and int(a[0][0].max()) < 2048
    assert torch.equal(a[0][0][:, 1:], a[0][1][:, :-1])


def test_synthetic_vocab_size_from_config():
    data = SimpleNamespace(name="synthetic", vocab_size=50)
    inputs, _ = next(loader(data, tokenizer=build_tokenizer(DataConfig()), batch=16))
    assert int(inputs.max()) < 50
    stream = iter(SyntheticTokenDataset(100_000, seq_len=8, dp_rank=0, dp_world=1, seed=0))
    assert int(next(stream)[0].max()) >= 2048


# ---------------------------------------------------------------- local files
def test_text_files(tmp_path, tok):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.txt").write_text("alpha beta gamma delta. " * 40)
    (tmp_path / "docs" / "b.txt").write_text("one two three four five. " * 40)
    (tmp_path / "docs" / "skip.md").write_text("not read")
    data = DataConfig(name="text", path=str(tmp_path / "docs"))
    batches = take(loader(data, tok, seq_len=16), 10)
    text = tok.decode([t for inputs, _ in batches for t in inputs.flatten().tolist()])
    assert "alpha" in text and "three" in text and "not read" not in text
    assert not (tmp_path / "cache" / "tokens").exists()  # streamed: nothing encoded ahead
    again = take(loader(data, tok, seq_len=16), 10)
    assert all(torch.equal(x[0], y[0]) for x, y in zip(batches, again))


def test_jsonl_file_with_text_field(tmp_path, tok):
    path = tmp_path / "d.jsonl"
    path.write_text(
        "".join(json.dumps({"body": f"record {i} says hello. " * 5}) + "\n" for i in range(20))
    )
    data = DataConfig(name="jsonl", path=str(path), text_field="body")
    inputs, labels = next(loader(data, tok, seq_len=16))
    assert inputs.shape == (4, 16) and "hello" in tok.decode(inputs.flatten().tolist())
    with pytest.raises(ConfigError, match="data.text_field='text' is not a key of .*d.jsonl:1"):
        loader(DataConfig(name="jsonl", path=str(path)), tok)


@pytest.mark.parametrize("name", ["text", "jsonl", "hf"])
def test_missing_path_is_a_config_error(tmp_path, tok, name):
    with pytest.raises(ConfigError, match=r"data.path='.*nowhere' does not exist"):
        loader(DataConfig(name=name, path=str(tmp_path / "nowhere")), tok)
    with pytest.raises(ConfigError, match=f"data.name={name} needs data.path"):
        loader(DataConfig(name=name), tok)


def test_too_little_text_is_a_config_error(tmp_path, tok):
    (tmp_path / "tiny.txt").write_text("hi")
    with pytest.raises(ConfigError, match=r"data.path=.* holds \d+ tokens, fewer than"):
        next(loader(DataConfig(name="text", path=str(tmp_path / "tiny.txt")), tok, seq_len=64))


def test_hf_local_dataset(tmp_path, tok):
    try:
        import datasets
    except ImportError:
        with pytest.raises(ConfigError, match=r"needs the 'datasets' package .*data.path="):
            loader(DataConfig(name="hf", path=str(tmp_path)), tok)
        return
    datasets.Dataset.from_dict({"text": ["local hugging face text. " * 20] * 4}).save_to_disk(
        str(tmp_path / "ds")
    )
    inputs, _ = next(loader(DataConfig(name="hf", path=str(tmp_path / "ds")), tok, seq_len=16))
    assert "hugging" in tok.decode(inputs.flatten().tolist())


# ---------------------------------------------------------------- registry
def test_unknown_dataset_suggests_a_name(tok):
    with pytest.raises(ConfigError, match=r"data.name='bultin' .* did you mean 'builtin'\?") as err:
        loader(DataConfig(name="bultin"), tok)
    assert "\n" not in str(err.value)


def test_core_plugin_manager_registers_the_datasets():
    from titan_plugins.plugins import get_plugin_manager

    datasets = get_plugin_manager(autoload=False).datasets()
    assert {"builtin", "synthetic", "text", "jsonl", "hf"} <= set(datasets)


def test_exports_and_omegaconf_configs(tok):
    from omegaconf import OmegaConf

    import titan_plugins.data as data_pkg

    assert sorted(data_pkg.__all__) == sorted(data_pkg._MODULE_OF)
    assert all(getattr(data_pkg, name) is not None for name in data_pkg.__all__)
    # The trainer hands over the composed (structured) config, not the dataclass.
    data = OmegaConf.structured(DataConfig(name="synthetic"))
    inputs, _ = next(loader(data, tok))
    assert inputs.shape == (4, 32)


def test_plugin_module_does_not_import_torch():
    code = (
        "import sys, titan_plugins.data.builtin as b; "
        "assert 'torch' not in sys.modules and 'numpy' not in sys.modules, 'heavy import'; "
        "print(len(b.DATASETS))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "12"  # builtin .. mix, chat, chat_sample, preference, preference_sample, prompts


def test_default_setup_is_fast():
    start = time.perf_counter()
    dl = loader(seq_len=128)
    next(dl)
    assert time.perf_counter() - start < 3.0


def test_train_tokenizer_cli_makes_a_tokenizer_a_run_accepts(tmp_path, capsys):
    from titan_plugins.data.train_tokenizer import main
    from titan_plugins.plugins import get_plugin_manager
    from titan_plugins.train.api import prepare_job

    path = tmp_path / "notes.jsonl"
    path.write_text("".join(json.dumps({"body": f"note {i}: the quick brown fox jumps. " * 8}) + "\n"
                            for i in range(30)))
    out = tmp_path / "tokenizer.json"
    assert main([str(path), "--out", str(out), "--vocab-size", "300", "--text-field", "body"]) == 0
    tok = Tokenizer.load(out)
    assert tok.vocab_size == 300 and tok.eos_id == 299
    assert tok.decode(tok.encode("the quick brown fox")) == "the quick brown fox"
    assert len(tok.encode("the quick brown fox")) < len("the quick brown fox")  # it learned merges
    # A 2048-vocab model accepts it; a 256-vocab one is refused before launch.
    pm = get_plugin_manager()
    data = ["data.name=jsonl", f"data.path={path}", "data.text_field=body", f"data.tokenizer={out}"]
    prepare_job(["model=qwen3", *data], pm)
    with pytest.raises(ConfigError, match=r"model.vocab_size=256 is smaller than data.tokenizer=.* \(300 ids\)"):
        prepare_job(["model=qwen3", "model.vocab_size=256", *data], pm)
    # Bad input: one line, exit code 2.
    assert main([str(tmp_path / "missing.txt"), "--out", str(tmp_path / "new.json")]) == 2
    assert capsys.readouterr().err.strip().startswith("error: DATA=")
