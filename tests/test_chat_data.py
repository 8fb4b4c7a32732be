"""Chat data (issue 27) and layout-independent streaming (issue 25): the global batch is
the same rows at any data-parallel degree / accumulation split, chat rows carry the
loss mask and document ids, resume is bitwise, the masked loss of a packed batch is
the per-conversation hand computation, and packing changes no conversation's loss."""

from __future__ import annotations

import json
import pickle
import random
from types import SimpleNamespace

import pytest
import torch

from titan_plugins.components.attention_masks import document_ids, documents
from titan_plugins.config.schema import DataConfig
from titan_plugins.data import build_dataloader, build_tokenizer
from titan_plugins.data.builtin import DATASETS
from titan_plugins.data.chat_source import CHAT_TOKENIZER, make_chat_tokenizer
from titan_plugins.errors import ConfigError
from titan_plugins.loss.token_loss import IGNORE_INDEX, GlobalTokenLoss
from titan_plugins.objectives.sft import SFTObjective

REGISTRY = {spec.name: spec for spec in DATASETS}
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()


def conversations(n: int, seed: int = 0, *, long_every: int = 0) -> list[dict]:
    rng = random.Random(seed)

    def say(k: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(k))

    rows = []
    for i in range(n):
        turns = [{"role": "system", "content": "be brief"}] if i % 3 == 0 else []
        for t in range(1 + i % 2):
            turns.append({"role": "user", "content": f"q{i}.{t} " + say(rng.randint(1, 8))})
            k = 60 if long_every and i % long_every == 0 else rng.randint(1, 10)
            turns.append({"role": "assistant", "content": say(k)})
        rows.append({"messages": turns})
    return rows


def write_jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def chat_config(path: str, **chat) -> SimpleNamespace:
    return SimpleNamespace(name="chat", path=path, split="train", tokenizer=str(CHAT_TOKENIZER),
                           num_workers=chat.pop("num_workers", 0), prefetch_factor=2, chat=chat)


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(SimpleNamespace(tokenizer=str(CHAT_TOKENIZER)))


def loader(data, tok, *, rank=0, world=1, batch=4, accum=1, seq_len=64, seed=0):
    return build_dataloader(data, tok, dp_rank=rank, dp_world=world, local_batch_size=batch,
                            seq_len=seq_len, seed=seed, datasets=REGISTRY, grad_accum_steps=accum)


def global_batches(data, tok, *, world, batch, accum, steps=3, seq_len=64):
    """The rows of each step's global batch, in global order (microbatch, rank, row)."""
    per_rank = []
    for r in range(world):
        dl = loader(data, tok, rank=r, world=world, batch=batch, accum=accum, seq_len=seq_len)
        per_rank.append([next(dl) for _ in range(steps * accum)])
    out = []
    for t in range(steps):
        parts = [per_rank[r][t * accum + m] for m in range(accum) for r in range(world)]
        out.append([torch.cat([p[k] for p in parts]) for k in range(2)]
                   + ([torch.cat([p.doc_ids for p in parts])] if parts[0].doc_ids is not None else []))
    return out


LAYOUTS = [dict(world=2, batch=2, accum=1), dict(world=1, batch=2, accum=2), dict(world=2, batch=1, accum=2)]


@pytest.mark.parametrize("kind", ["jsonl", "chat"])
def test_global_batch_does_not_depend_on_the_layout(tmp_path, tok, kind):
    """dp=1 x batch 4 == dp=2 x batch 2 == dp=1 x batch 2 x accum 2 (== dp=2 x 1 x 2),
    on a two-file folder (issue 25: the files used to be split across ranks)."""
    if kind == "jsonl":
        for k in range(2):
            write_jsonl(tmp_path / f"p{k}.jsonl", [{"text": f"F{k} line {i} " + " ".join(WORDS[: 1 + i % 9])}
                                                  for i in range(600)])
        data = DataConfig(name="jsonl", path=str(tmp_path), num_workers=0)
    else:
        for k in range(2):
            write_jsonl(tmp_path / f"p{k}.jsonl", conversations(300, seed=k))
        data = chat_config(str(tmp_path))
    ref = global_batches(data, tok, world=1, batch=4, accum=1)
    for layout in LAYOUTS:
        got = global_batches(data, tok, **layout)
        for step, (a, b) in enumerate(zip(ref, got)):
            assert all(torch.equal(x, y) for x, y in zip(a, b)), f"{layout}: step {step} differs"
    # with a loader worker per rank too
    data.num_workers = 1
    got = global_batches(data, tok, world=2, batch=1, accum=2)
    assert all(torch.equal(x, y) for a, b in zip(ref, got) for x, y in zip(a, b))


def test_a_small_file_of_one_long_line_still_fills_every_row(tmp_path, tok):
    """A 9 KB single-line text file is cut into 1 KB byte ranges; only the first holds a
    line start, so the streams of the other rows used to come up empty (0 tokens)."""
    (tmp_path / "one_line.txt").write_text("the quick brown fox jumps over the lazy dog. " * 200)
    data = DataConfig(name="text", path=str(tmp_path), num_workers=0)
    ref = global_batches(data, tok, world=1, batch=4, accum=1, seq_len=32)
    got = global_batches(data, tok, world=2, batch=2, accum=1, seq_len=32)
    assert all(torch.equal(x, y) for a, b in zip(ref, got) for x, y in zip(a, b))


def test_ranks_read_disjoint_streams(tmp_path, tok):
    write_jsonl(tmp_path / "c.jsonl", conversations(400))
    seen = []
    for r in range(2):
        dl = loader(chat_config(str(tmp_path / "c.jsonl")), tok, rank=r, world=2, batch=2)
        text = tok.decode([t for b in [next(dl) for _ in range(5)] for t in b[0].flatten().tolist()])
        seen.append({w for w in text.split() if w.startswith("q")})
    assert seen[0] and seen[1] and not seen[0] & seen[1]


def test_chat_rows_mask_and_documents(tmp_path, tok):
    """Each packed row is whole conversations in file order: inputs ids[:-1], labels ids[1:]
    where the encoder's mask counts them (else IGNORE_INDEX), one document id each, then
    padding (IGNORE_INDEX, its own document)."""
    from titan_plugins.chat.encode import encode_conversation
    from titan_plugins.chat.formats import ChatFields, to_messages
    from titan_plugins.chat.template import load_chat_template

    rows = conversations(40)
    path = write_jsonl(tmp_path / "c.jsonl", rows)
    template = load_chat_template(None, CHAT_TOKENIZER)
    expected = []
    for i, row in enumerate(rows):
        ids, mask = encode_conversation(to_messages(row, ChatFields(), where=str(i)), template, tok)
        expected.append((ids[:-1], [t if m else IGNORE_INDEX for t, m in zip(ids[1:], mask[1:])]))
    by_ids = {tuple(ids[:96]): labels[:96] for ids, labels in expected}  # truncated: the start
    dl = loader(chat_config(path), tok, batch=1, seq_len=96)
    found = 0
    for _ in range(6):
        batch = next(dl)
        x, y, d = batch[0][0].tolist(), batch[1][0].tolist(), batch.doc_ids[0].tolist()
        assert d == sorted(d) and d[0] == 0  # contiguous documents, in order
        for doc in range(max(d) + 1):
            cols = [i for i, v in enumerate(d) if v == doc]
            ids, labels = tuple(x[i] for i in cols), [y[i] for i in cols]
            if all(t == IGNORE_INDEX for t in labels):  # the padding: last, pad tokens
                assert doc == max(d) and set(ids) == {tok.pad_id}
                continue
            assert by_ids[ids] == labels
            found += 1
    assert found >= 6


def test_padding_when_packing_is_off(tmp_path, tok):
    path = write_jsonl(tmp_path / "c.jsonl", conversations(60))
    batch = next(loader(chat_config(path, pack=False), tok, batch=4, seq_len=96))
    assert batch.doc_ids is None
    for x, y in zip(batch[0], batch[1]):
        n = int((y != IGNORE_INDEX).nonzero().max()) + 1
        assert (x[n + 1 :] == tok.pad_id).all() and (y[n:] == IGNORE_INDEX).all()


def test_overlong_conversations_truncated_or_dropped_and_counted(tmp_path, tok):
    rows = conversations(60, long_every=4)  # 15 conversations over 64 positions
    path = write_jsonl(tmp_path / "c.jsonl", rows)
    counts = {}
    for rule in ("truncate", "drop"):
        dl = loader(chat_config(path, overlong=rule), tok, batch=1, seq_len=64)
        for _ in range(8):
            next(dl)
        counts[rule] = dl.stats()
    assert counts["truncate"]["truncated"] >= 3 and counts["truncate"]["dropped"] == 0
    assert counts["drop"]["dropped"] >= 3 and counts["drop"]["truncated"] == 0
    with pytest.raises(ConfigError, match="data.chat.overlong='cut'"):
        loader(chat_config(path, overlong="cut"), tok)


@pytest.mark.parametrize("workers", [0, 1])
def test_chat_resume_mid_epoch_is_bitwise(tmp_path, tok, workers):
    path = write_jsonl(tmp_path / "c.jsonl", conversations(500))
    data = chat_config(path, num_workers=workers)
    run = loader(data, tok, rank=1, world=2, batch=2)
    for _ in range(5):
        next(run)
    state = pickle.loads(pickle.dumps(run.state_dict()))
    expected = [next(run) for _ in range(6)]
    resumed = loader(data, tok, rank=1, world=2, batch=2)
    resumed.load_state_dict(state)
    for a, b in zip(expected, [next(resumed) for _ in range(6)]):
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and torch.equal(a.doc_ids, b.doc_ids)
    with pytest.raises(ConfigError, match="dp_world|global_rows|another data-parallel"):
        loader(data, tok, rank=0, world=1, batch=2).load_state_dict(state)


def test_shipped_chat_tokenizer_is_reproducible(tmp_path, tok):
    made = make_chat_tokenizer(tmp_path / "tok")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert json.loads((made / name).read_text()) == json.loads((CHAT_TOKENIZER / name).read_text())
    assert tok.vocab_size == 2048 and tok.eos_id == 2047
    assert tok.encode("<|im_start|>user\nhi<|im_end|>")[0] == 2046


# ----------------------------------------------------------------- loss / model
def _tiny_qwen3(attn_mask: str = "block_causal"):
    from dataclasses import replace

    from titan_qwen3.config import FLAVORS
    from titan_qwen3.model import Qwen3Model

    from titan_plugins.components.attention_masks import AttentionMask

    cfg = replace(FLAVORS["debugmodel"], n_layers=2, dim=64, n_heads=4, n_kv_heads=2, head_dim=16,
                  hidden_dim=128, max_seq_len=256, attn_mask=AttentionMask(attn_mask), eos_id=2047)
    torch.manual_seed(0)
    model = Qwen3Model(cfg)
    model.init_weights()
    return model.eval()


def test_packed_loss_is_the_hand_computation_and_packing_changes_no_conversation(tmp_path, tok):
    """One packed batch: the global-token loss equals sum over conversations of the CE of
    their target tokens, each conversation run alone (its own forward, positions from 0),
    divided by the number of targets; and every conversation's loss matches."""
    pytest.importorskip("titan_qwen3")
    path = write_jsonl(tmp_path / "c.jsonl", conversations(30))
    batch = next(loader(chat_config(path), tok, batch=2, seq_len=160))
    assert int(batch.doc_ids.max()) >= 2  # a row packs two conversations (and padding)
    model = _tiny_qwen3()
    loss_fn = GlobalTokenLoss()
    loss_fn.global_tokens = float((batch[1] != IGNORE_INDEX).sum())
    with torch.no_grad(), documents(batch.doc_ids) as docs:
        logits = model(batch[0])
        packed = loss_fn(logits, batch[1])
    assert docs.used
    total, count, n_docs = 0.0, 0, 0
    for b in range(2):
        d = batch.doc_ids[b]
        for doc in range(int(d.max()) + 1):
            cols = (d == doc).nonzero().flatten()
            x, y = batch[0][b, cols][None], batch[1][b, cols]
            if (y == IGNORE_INDEX).all():
                continue  # the padding
            with torch.no_grad(), documents(torch.zeros_like(x)):  # one document (an <|im_end|>
                alone = model(x)[0].double().log_softmax(-1)  # inside it is no boundary)
            keep = y != IGNORE_INDEX
            nll = -alone[keep.nonzero().flatten(), y[keep]]
            in_pack = logits[b, cols].double().log_softmax(-1)
            assert torch.allclose(-in_pack[keep.nonzero().flatten(), y[keep]], nll, atol=2e-5)
            total, count, n_docs = total + float(nll.sum()), count + int(keep.sum()), n_docs + 1
    assert n_docs >= 3 and count == loss_fn.global_tokens
    assert float(packed) == pytest.approx(total / count, rel=1e-5)


def test_a_causal_model_leaves_the_documents_unused_and_shapes_must_match():
    pytest.importorskip("titan_qwen3")
    tokens = torch.randint(0, 2000, (2, 16))
    docs = torch.zeros(2, 16, dtype=torch.long)
    with torch.no_grad(), documents(docs) as given:
        _tiny_qwen3("causal")(tokens)
    assert not given.used  # the trainer turns this into one error line
    with documents(docs), pytest.raises(ValueError, match="document ids have shape"):
        document_ids(tokens[:1], 0)
    assert document_ids(torch.tensor([[5, 0, 5, 0]]), 0).tolist() == [[0, 0, 1, 1]]  # no context


def test_a_global_batch_without_a_trainable_token_is_one_error():
    from titan_plugins.data.loader import Batch
    from titan_plugins.train.trainer import Trainer

    data = SimpleNamespace(data=SimpleNamespace(name="chat"))
    fake = SimpleNamespace(dp_group=None, device=torch.device("cpu"), objective=SFTObjective(), job=data, config=data)
    x = torch.zeros(2, 8, dtype=torch.long)
    with pytest.raises(ConfigError, match="no trainable token"):
        Trainer.train_step(fake, [Batch(x, torch.full_like(x, IGNORE_INDEX))])


# ----------------------------------------------------------------- multi-rank parity
QWEN3_TINY = ["model=qwen3", "model.n_layers=2", "model.dim=64", "model.n_heads=4", "model.n_kv_heads=2",
              "model.head_dim=16", "model.hidden_dim=128", "model.enable_weight_tying=false",
              "training.seq_len=64", "training.steps=3", "metrics.tensorboard=false",
              "metrics.console=false", "data=chat_sample", "data.num_workers=0"]


@pytest.mark.slow
def test_chat_loss_and_grad_norm_match_single_rank_under_tp_pp_and_accumulation(tmp_path):
    """The same global batch of packed conversations (4 rows) under one rank, gradient
    accumulation, fsdp2_tp2 (loss_parallel) and pp2: loss and grad norm within the
    project's parity tolerance (the loss divides by the global batch's targets)."""
    pytest.importorskip("titan_qwen3")
    from titan_plugins.compare.tolerances import GRAD_NORM_PARITY, LOSS_PARITY
    from titan_plugins.train.api import run

    path = write_jsonl(tmp_path / "c.jsonl", conversations(300))
    base = [*QWEN3_TINY, f"data.path={path}"]

    def go(name, *overrides):
        r = run([*base, *overrides], run_dir=tmp_path / name, timeout=300)
        assert r.returncode == 0, f"{name}: {r.error}\n{r.stderr[-3000:]}"
        return r

    go("seed", "checkpoint.create_seed=true")
    seed = f"checkpoint.init_from={tmp_path / 'seed' / 'checkpoints' / 'seed'}"
    ref = go("single", seed, "training.local_batch_size=4")
    layouts = {
        "accum2": ["training.local_batch_size=2", "training.grad_accum_steps=2"],
        "fsdp2_tp2": ["parallelism=fsdp2_tp2", "training.local_batch_size=2"],
        "pp2": ["parallelism=pp2", "training.local_batch_size=4"],
    }
    for name, overrides in layouts.items():
        got = go(name, seed, *overrides)
        print(f"{name}: loss {got.losses} vs {ref.losses}; grad norm {got.grad_norms} vs {ref.grad_norms}")
        for step, (a, b) in enumerate(zip(ref.losses, got.losses), 1):
            assert LOSS_PARITY.allows(a, b, step), f"{name} step {step}: loss {b} vs {a}"
        for step, (a, b) in enumerate(zip(ref.grad_norms, got.grad_norms), 1):
            assert GRAD_NORM_PARITY.allows(a, b, step), f"{name} step {step}: grad norm {b} vs {a}"


def test_mix_takes_chat_entries(tmp_path, tok):
    """data.mix with a chat source and a text source: every row carries document ids
    (a text row's from its EOS tokens), and the mix is the same at another layout."""
    chat = write_jsonl(tmp_path / "c.jsonl", conversations(300))
    text = write_jsonl(tmp_path / "t.jsonl", [{"text": f"plain {i} " + " ".join(WORDS)} for i in range(400)])
    mix = [{"name": "chat", "path": chat, "weight": 1}, {"name": "jsonl", "path": text, "weight": 1}]
    data = SimpleNamespace(name="mix", mix=mix, path=None, text_field="text", split="train",
                           tokenizer=str(CHAT_TOKENIZER), num_workers=0, prefetch_factor=2, chat={})
    ref = global_batches(data, tok, world=1, batch=4, accum=1, steps=4)
    rows = [tok.decode(r.tolist()) for step in ref for r in step[0]]
    assert any("plain" in r for r in rows) and any("<|im_start|>" in r for r in rows)
    got = global_batches(data, tok, world=2, batch=1, accum=2, steps=4)
    assert all(torch.equal(x, y) for a, b in zip(ref, got) for x, y in zip(a, b))
    for step in ref:
        x, docs = step[0], step[2]
        plain = [i for i, r in enumerate(x) if "plain" in tok.decode(r.tolist())]
        for i in plain:
            assert torch.equal(docs[i], document_ids(x[i : i + 1], tok.eos_id)[0])


def test_trainer_refuses_packed_rows_a_model_ignores():
    """A causal model never asks for the document ids: the step stops with one line."""
    pytest.importorskip("titan_qwen3")
    import contextlib

    from titan_plugins.data.loader import Batch
    from titan_plugins.train.trainer import Trainer

    fake = SimpleNamespace(dp_group=None, device=torch.device("cpu"), objective=SFTObjective(),
                           job=SimpleNamespace(data=SimpleNamespace(name="chat")),
                           config=SimpleNamespace(data=SimpleNamespace(name="chat")),
                           model=SimpleNamespace(pp=False, parts=[_tiny_qwen3("causal")]),
                           loss_context=contextlib.nullcontext)
    x = torch.randint(0, 2000, (2, 8))
    docs = torch.tensor([[0] * 4 + [1] * 4] * 2)
    with pytest.raises(ConfigError, match="ignored their document ids"):
        Trainer.train_step(fake, [Batch(x, x, docs)])


@pytest.mark.parametrize("pack", [True, False])
def test_a_chat_file_smaller_than_one_row_trains_padded(tmp_path, tok, pack):
    """Issue 35.5: one short conversation (fewer than training.seq_len + 1 tokens in the
    whole file) is a padded row, every epoch, as the docs say; raw text that small is
    refused naming the tokens it has and needs."""
    from titan_plugins.chat.encode import encode_conversation
    from titan_plugins.chat.formats import ChatFields, to_messages
    from titan_plugins.chat.template import load_chat_template

    row = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]}
    path = write_jsonl(tmp_path / "one.jsonl", [row])
    ids, mask = encode_conversation(to_messages(row, ChatFields(), where="1"),
                                    load_chat_template(None, CHAT_TOKENIZER), tok)
    assert len(ids) < 128
    batch = next(loader(chat_config(path, pack=pack), tok, batch=2, seq_len=128))
    n = len(ids) - 1
    for x, y in zip(batch[0], batch[1]):  # both rows: the conversation, then padding
        assert x[:n].tolist() == ids[:-1] and (x[n:] == tok.pad_id).all()
        assert y[:n].tolist() == [t if m else IGNORE_INDEX for t, m in zip(ids[1:], mask[1:])]
        assert (y[n:] == IGNORE_INDEX).all()
    (tmp_path / "tiny.txt").write_text("hi there")
    with pytest.raises(ConfigError, match=r"holds \d+ tokens, fewer than training.seq_len \+ 1 = 129"):
        next(loader(DataConfig(name="text", path=str(tmp_path / "tiny.txt"), num_workers=0), tok, seq_len=128))
