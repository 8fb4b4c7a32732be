"""Chat data: packing against padding, and the chat loader against the trainer.

    OMP_NUM_THREADS=1 python benchmarks/bench_chat_packing.py [--n 2000] [--seq-len 1024] [--batch 4] [--steps 6]

Generates ``--n`` conversations with a realistic spread of lengths (1-4 user/assistant
exchanges, a system turn in a third of them, words per message log-normal with a
median of ~25 and a long tail, so a few conversations exceed ``--seq-len``), written as
a ``messages`` JSONL, rendered with the shipped ChatML tokenizer. Then, for
``data.chat.pack`` true and false:

- ``loader``: rows/s and positions/s of ``build_dataloader`` alone (after the first
  batch), the fraction of positions that are not padding and that are trained on;
- ``trainer``: forward + backward + AdamW of qwen3 (debug flavor cut to 4 layers of
  dim 256) on those batches in this process, packed and padded steps alternating, the
  median seconds per step and *conversation* tokens (non-padding positions) per second;
  the packing/padding ratio of that number.

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch

WORDS = ("the of and to in is that for it as with was on be by this are or from at an list value "
         "function class return import loop error string number file module python").split()


def write_conversations(path: Path, n: int, seed: int = 0) -> Path:
    rng = random.Random(seed)

    def say() -> str:
        k = max(1, min(600, int(rng.lognormvariate(3.2, 0.9))))  # median ~25 words
        return " ".join(rng.choice(WORDS) for _ in range(k))

    with open(path, "w") as f:
        for i in range(n):
            turns = [{"role": "system", "content": "You are helpful."}] if i % 3 == 0 else []
            for _ in range(rng.choice((1, 1, 2, 2, 3, 4))):
                turns += [{"role": "user", "content": say()}, {"role": "assistant", "content": say()}]
            f.write(json.dumps({"messages": turns}) + "\n")
    return path


def make_loader(path: Path, pack: bool, seq_len: int, batch: int):
    from titan_plugins.data import build_dataloader, build_tokenizer
    from titan_plugins.data.builtin import DATASETS

    data = SimpleNamespace(name="chat", path=str(path), split="train", tokenizer=None, num_workers=0,
                           prefetch_factor=2, chat={"pack": pack})
    return build_dataloader(data, build_tokenizer(data), dp_rank=0, dp_world=1, local_batch_size=batch,
                            seq_len=seq_len, seed=0, datasets={s.name: s for s in DATASETS})


def _padding(inputs: list[int], labels: list[int], pad_id: int) -> int:
    """Trailing positions of a row that are padding (pad id, no target); a conversation's
    own last <|im_end|> may count as one (pad id = <|im_end|> here): +-1 per row."""
    from titan_plugins.loss.token_loss import IGNORE_INDEX

    n = 0
    while n < len(inputs) and inputs[-1 - n] == pad_id and labels[-1 - n] == IGNORE_INDEX:
        n += 1
    return n


def loader_stats(path: Path, pack: bool, seq_len: int, batch: int, batches: int) -> dict:
    from titan_plugins.loss.token_loss import IGNORE_INDEX

    dl = make_loader(path, pack, seq_len, batch)
    pad_id = dl.dataset.pad_id
    next(dl)
    real = trained = 0
    start = time.perf_counter()
    for _ in range(batches):
        b = next(dl)
        real += sum(seq_len - _padding(x, y, pad_id) for x, y in zip(b[0].tolist(), b[1].tolist()))
        trained += int((b[1] != IGNORE_INDEX).sum())
    seconds = time.perf_counter() - start
    positions = batches * batch * seq_len
    return {"rows_per_s": round(batches * batch / seconds, 1), "positions_per_s": round(positions / seconds),
            "non_padding_fraction": round(real / positions, 4), "trained_fraction": round(trained / positions, 4),
            "stats": dl.stats()}


def trainer_stats(path: Path, seq_len: int, batch: int, steps: int) -> dict:
    """Packed and padded steps alternate (the same model shapes, so machine load hits both
    alike); the median step of each."""
    from dataclasses import replace

    from titan_qwen3.config import FLAVORS
    from titan_qwen3.model import Qwen3Model

    from titan_plugins.components.attention_masks import AttentionMask, documents
    from titan_plugins.loss.token_loss import IGNORE_INDEX, GlobalTokenLoss

    cfg = replace(FLAVORS["debugmodel"], n_layers=4, dim=256, max_seq_len=seq_len,
                  attn_mask=AttentionMask.block_causal, eos_id=2047)
    modes = {}
    for pack in (True, False):
        torch.manual_seed(0)
        model = Qwen3Model(cfg)
        model.init_weights()
        dl = make_loader(path, pack, seq_len, batch)
        modes[pack] = (model, torch.optim.AdamW(model.parameters(), lr=1e-4), dl, [], [])
    loss_fn = GlobalTokenLoss()
    for step in range(steps + 1):
        for model, opt, dl, times, real in modes.values():
            b = next(dl)
            loss_fn.global_tokens = float((b[1] != IGNORE_INDEX).sum())
            start = time.perf_counter()
            with documents(b.doc_ids if b.doc_ids is not None else torch.zeros_like(b[0])):
                loss_fn(model(b[0]), b[1]).backward()
            opt.step()
            opt.zero_grad()
            if step:  # the first step warms up
                times.append(time.perf_counter() - start)
                real.append(sum(seq_len - _padding(x, y, dl.dataset.pad_id)
                                for x, y in zip(b[0].tolist(), b[1].tolist())))
    out = {}
    for pack, (_, _, _, times, real) in modes.items():
        step_s = statistics.median(times)
        out["packed" if pack else "padded"] = {
            "s_per_step": round(step_s, 3), "positions_per_s": round(batch * seq_len / step_s),
            "conversation_tokens_per_s": round(statistics.mean(real) / step_s)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--batches", type=int, default=40, help="loader batches timed")
    ap.add_argument("--steps", type=int, default=6, help="trainer steps timed")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = write_conversations(Path(tmp) / "chat.jsonl", args.n)
        out: dict = {"conversations": args.n, "seq_len": args.seq_len, "batch": args.batch}
        for pack in (True, False):
            key = "packed" if pack else "padded"
            out[key] = {"loader": loader_stats(path, pack, args.seq_len, args.batch, args.batches)}
        for key, stats in trainer_stats(path, args.seq_len, args.batch, args.steps).items():
            out[key]["trainer"] = stats
        p, q = out["packed"], out["padded"]
        out["packing_over_padding"] = {
            "non_padding_fraction": round(p["loader"]["non_padding_fraction"] / q["loader"]["non_padding_fraction"], 2),
            "conversation_tokens_per_s": round(p["trainer"]["conversation_tokens_per_s"]
                                               / q["trainer"]["conversation_tokens_per_s"], 2),
        }
        out["loader_over_trainer_positions_per_s"] = round(
            p["loader"]["positions_per_s"] / p["trainer"]["positions_per_s"], 1)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
