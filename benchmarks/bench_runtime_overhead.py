"""Steady-state tokens/s of ``titan-run`` (one rank) against a plain eager loop.

Both train the test plugin's ``tiny`` model (flavor ``wide`` unless --flavor) on
the same synthetic batches, with AdamW, gradient clipping and fp32, one thread,
in one invocation: plain, titan, plain, titan (interleaved against machine
noise), reporting the best rate of each and the overhead in percent.

    OMP_NUM_THREADS=1 python benchmarks/bench_runtime_overhead.py [--steps 30]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
os.environ.setdefault("OMP_NUM_THREADS", "1")


def plain_loop(flavor: str, steps: int, batch: int, seq_len: int, seed: int = 0) -> float:
    import tiny_plugin
    import torch
    import torch.nn.functional as F

    from titan_plugins.data.packing import SyntheticTokenDataset

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    torch.manual_seed(seed)
    cfg = tiny_plugin.FLAVORS[flavor]
    model = tiny_plugin.build(cfg)
    model.init_weights()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, betas=(0.9, 0.95))
    data = iter(SyntheticTokenDataset(cfg.vocab_size, seq_len=seq_len, dp_rank=0, dp_world=1, seed=seed))
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        pairs = [next(data) for _ in range(batch)]
        x = torch.stack([p[0] for p in pairs])
        y = torch.stack([p[1] for p in pairs])
        loss = F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten(), reduction="sum") / y.numel()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()
        times.append(time.perf_counter() - t0)
    steady = sorted(times[1:])
    return batch * seq_len / steady[len(steady) // 2]


def titan_run(flavor: str, steps: int, batch: int, seq_len: int) -> float:
    from titan_plugins.train.api import run

    with tempfile.TemporaryDirectory() as tmp:
        result = run(
            ["model=tiny", f"model.flavor={flavor}", "data=synthetic", f"training.steps={steps}",
             f"training.local_batch_size={batch}", f"training.seq_len={seq_len}", "metrics.tensorboard=false",
             "metrics.console=false", "training.max_norm=1.0"],
            run_dir=tmp, extra_plugins=["tiny_plugin"], timeout=900,
        )
        if result.returncode:
            raise SystemExit(f"titan-run failed: {result.error}")
        return float(result.tokens_per_s)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--flavor", default="wide")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    plain, titan = [], []
    for _ in range(args.rounds):
        plain.append(plain_loop(args.flavor, args.steps, args.batch, args.seq_len))
        titan.append(titan_run(args.flavor, args.steps, args.batch, args.seq_len))
    best_plain, best_titan = max(plain), max(titan)
    print(json.dumps({
        "flavor": args.flavor, "batch": args.batch, "seq_len": args.seq_len, "steps": args.steps,
        "threads": int(os.environ["OMP_NUM_THREADS"]),
        "plain_tokens_per_s": [round(v, 1) for v in plain],
        "titan_tokens_per_s": [round(v, 1) for v in titan],
        "overhead_pct": round(100.0 * (best_plain - best_titan) / best_plain, 2),
    }, indent=1))


if __name__ == "__main__":
    main()
