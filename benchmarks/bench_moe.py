"""Tokens/s of one MoE layer (8 experts, top-2) vs a dense SwiGLU with the same
active parameters per token, forward + backward, one process, same run.

    OMP_NUM_THREADS=1 python benchmarks/bench_moe.py [--dim 256 --hidden 512 --tokens 4096]

Dense hidden = top_k * expert hidden, no shared experts, so both layers apply the
same number of weights to every token; the MoE adds routing, sorting and the
router matmul. Prints JSON with both rates, their ratio and the grouped-GEMM path.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from titan_plugins.components.feed_forward import FeedForward
from titan_plugins.components.moe import MoE, MoEConfig


def _rate(module: torch.nn.Module, x: torch.Tensor, steps: int, warmup: int) -> float:
    g = torch.randn_like(x)
    for i in range(warmup + steps):
        if i == warmup:
            start = time.perf_counter()
        x.grad = None
        y = module(x)
        y.backward(g)  # not y.sum(): grouped_mm's backward rejects stride-0 gradients
    return steps * x.shape[0] * x.shape[1] / (time.perf_counter() - start)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--no-grouped-mm", action="store_true")
    args = p.parse_args()

    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    cfg = MoEConfig(
        num_experts=args.experts,
        top_k=args.top_k,
        num_shared_experts=0,
        use_grouped_mm=not args.no_grouped_mm,
    )
    moe = MoE(cfg, args.dim, args.hidden).to(dtype)
    moe.init_weights(0.02, torch.device("cpu"))
    dense = FeedForward(args.dim, args.top_k * args.hidden).to(dtype)
    dense.init_weights(0.02)
    x = torch.randn(1, args.tokens, args.dim, dtype=dtype, requires_grad=True)

    # interleave, best of two rounds each: the machine is shared
    moe_tps = dense_tps = 0.0
    for _ in range(2):
        dense_tps = max(dense_tps, _rate(dense, x, args.steps, args.warmup))
        moe_tps = max(moe_tps, _rate(moe, x, args.steps, args.warmup))
    w1 = moe.experts.w1
    print(
        json.dumps(
            {
                "moe_tokens_per_s": round(moe_tps),
                "dense_tokens_per_s": round(dense_tps),
                "ratio": round(moe_tps / dense_tps, 3),
                "grouped_mm_path": "torch._grouped_mm"
                if moe.experts._grouped_mm_fits(w1, moe.experts.w2)
                else "per-expert loop",
                "torch": torch.__version__,
                "threads": torch.get_num_threads(),
                "shape": vars(args),
            }
        )
    )


if __name__ == "__main__":
    main()
