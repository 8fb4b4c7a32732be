"""A DPO step against its floor: two SFT forwards (one with gradient, one without) and one
backward on the same pairs, with LoRA and with full fine-tuning.

    OMP_NUM_THREADS=1 python benchmarks/bench_dpo.py [--pairs 4] [--seq-len 256] [--steps 6]

The model is qwen3's debug flavor cut to 4 layers of dim 256; the batch is ``--pairs``
pairs of the shipped preference sample (chosen rows, then rejected rows: one forward).

- ``dpo``: what ``objective=dpo`` runs per microbatch (titan_plugins/objectives/step.py):
  the reference forward without gradient (LoRA: the same model, adapters off; full: a
  frozen copy), the policy forward, the DPO loss from ``token_nll``, backward, AdamW;
- ``floor``: the same two forwards with the SFT loss (``token_loss_sum``) on the policy's,
  backward, AdamW: what any implementation of DPO must at least do.

The modes alternate step by step (machine load hits both alike); median seconds per step
and the ratio dpo / floor (the target is at most 1.1). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import replace
from types import SimpleNamespace

import torch


def _batch(pairs: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    from titan_plugins.train.data.chat_source import CHAT_TOKENIZER
    from titan_plugins.train.data.loader import DataLoader
    from titan_plugins.train.data.preference_source import build_preference_sample
    from titan_plugins.train.data.tokenizer import Tokenizer

    cfg = SimpleNamespace(name="preference_sample", path=None, split="train", tokenizer=None, preference=None)
    ds = build_preference_sample(cfg, Tokenizer.load(CHAT_TOKENIZER), dp_rank=0, dp_world=1, seq_len=seq_len, seed=0)
    ds.set_layout(2 * pairs, 1)
    b = next(DataLoader(ds, local_batch_size=2 * pairs, seq_len=seq_len))
    return b[0], b[1]


def _model(seq_len: int, lora: bool) -> torch.nn.Module:
    from titan_qwen3.config import FLAVORS
    from titan_qwen3.model import Qwen3Model

    from titan_plugins.peft.lora import apply_lora, freeze_base, init_adapters

    torch.manual_seed(0)
    model = Qwen3Model(replace(FLAVORS["debugmodel"], n_layers=4, dim=256, max_seq_len=seq_len))
    model.init_weights()
    if lora:
        peft = SimpleNamespace(rank=8, alpha=16.0, dropout=0.0, target_modules=["wq", "wk", "wv", "wo"])
        apply_lora(model, peft, exclude=("tok_embeddings", "norm", "output"))
        freeze_base(model)
        init_adapters(model, 0)
    return model.train()


def _time_mode(lora: bool, x: torch.Tensor, y: torch.Tensor, steps: int) -> dict:
    from titan_plugins.objectives.dpo import DPOObjective
    from titan_plugins.objectives.reference import adapters_off
    from titan_plugins.train.loss import count_tokens, token_loss_sum

    objective = DPOObjective(SimpleNamespace(loss_type="sigmoid", beta=0.1, label_smoothing=0.0, simpo_gamma=0.5))
    seq_len = x.shape[1]
    policy = _model(seq_len, lora)
    frozen = None if lora else _model(seq_len, False).requires_grad_(False)
    opt = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=1e-5)

    def reference() -> torch.Tensor:
        with torch.no_grad():
            if frozen is not None:
                return frozen(x)
            with adapters_off([policy]):
                return policy(x)

    def dpo_step() -> None:
        scale = tuple(float(v) for v in objective.count(y))
        ref = objective.reference_stats(reference(), y)
        loss, _ = objective.loss(policy(x), y, scale=scale, reference=ref)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def floor_step() -> None:
        reference()
        (token_loss_sum(policy(x), y) / count_tokens(y)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    times: dict[str, list[float]] = {"dpo": [], "floor": []}
    for step in range(steps + 1):
        for name, fn in (("dpo", dpo_step), ("floor", floor_step)):
            start = time.perf_counter()
            fn()
            if step:  # the first step warms up
                times[name].append(time.perf_counter() - start)
    dpo, floor = statistics.median(times["dpo"]), statistics.median(times["floor"])
    return {"dpo_s": round(dpo, 4), "floor_s": round(floor, 4), "ratio": round(dpo / floor, 3)}


def run(pairs: int, seq_len: int, steps: int) -> dict:
    x, y = _batch(pairs, seq_len)
    return {"pairs": pairs, "seq_len": seq_len, "steps": steps,
            "lora": _time_mode(True, x, y, steps), "full": _time_mode(False, x, y, steps)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pairs", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--steps", type=int, default=6)
    args = ap.parse_args()
    print(json.dumps(run(args.pairs, args.seq_len, args.steps)))


if __name__ == "__main__":
    main()
