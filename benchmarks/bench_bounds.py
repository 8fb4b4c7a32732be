"""How far a training step on this CPU is from what its kernels allow.

    python benchmarks/bench_bounds.py kernels [--models qwen3,llama4,deepseek_v3]
        [--precisions fp32,bf16] [--warmup 3] [--steps 2] [--rounds 3]
    python benchmarks/bench_bounds.py kernel-dtypes [--threads 2]
    python benchmarks/bench_bounds.py ranks [--model deepseek_v3] [--preset fsdp4_tp2_ep2]
        [--ranks 8] [--dp 4] [--local-batch 4] [--seq 128] [--steps 7] [--rounds 2]

``kernels``: one-rank ``titan-run`` of each debug flavor (batch 2 x seq 256, random
tokens, AC and compile off, ``OMP_NUM_THREADS`` = cores), with torch.profiler on
``--steps`` steps after ``--warmup``, ``--rounds`` runs per precision (precisions
interleaved; medians over all profiled steps). From rank 0's trace it sums, per step, the wall
time covered by the dense kernels (matmuls: ``mm``, ``bmm``, ``addmm``, ``_grouped_mm``;
attention: the CPU flash-attention forward and backward), which TorchTitan runs too
(same ops, same shapes). ``ceiling`` = step / kernel time: the speedup if every other
op (norms, rope, activations, residuals, casts, the loss, the optimizer, Python) cost
nothing. A trainer that runs the same kernels cannot beat another by more than the
other's step over these kernels' time; bf16 cannot beat fp32 by more than fp32's step
over bf16's kernel time (``bf16_over_fp32_ceiling``, printed when both ran).

``kernel-dtypes``: the two dense kernels alone in bf16 against fp32: square matmuls
(n = 512, 1024, 2048; :func:`titan_plugins.train.peak.measure_matmul_tflops`, the probe
behind the console's CPU MFU) and causal SDPA forward + backward on the debug flavors'
attention shapes (and at seq 1024), in bf16, in fp32, and bf16 inputs upcast to fp32.

``ranks``: the same global batch (``--dp`` x ``--local-batch`` sequences of ``--seq``)
on one rank with every core, then under ``--preset`` on ``--ranks`` gloo ranks,
interleaved ``--rounds`` times. ``parallel_factor`` = multi-rank step / one-rank step:
the cost of splitting the same work over processes that share the cores (the
collectives over loopback TCP, smaller matmuls on one thread each, DTensor dispatch).
On a box with fewer cores than ranks the one-rank step is the floor for the
multi-rank one: the ranks do the same FLOPs on the same cores.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _titan_run import steady_step_s, step_times  # noqa: E402

PRECISIONS = {"fp32": "fp32", "bf16": "bf16_mixed"}
DENSE_KERNELS = frozenset({
    "aten::mm", "aten::bmm", "aten::addmm", "aten::baddbmm", "aten::_grouped_mm",
    "aten::_scaled_dot_product_flash_attention_for_cpu",
    "aten::_scaled_dot_product_flash_attention_for_cpu_backward",
})


def _covered(intervals: list[tuple[float, float]]) -> float:
    """Total length of the union of ``(start, end)`` intervals (nested calls count once)."""
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if start > end:
            total += stop - start
            end = stop
        elif stop > end:
            total += stop - end
            end = stop
    return total


def kernel_share(trace_file: Path) -> list[dict[str, float]]:
    """Per profiled step of one Chrome trace: step seconds and dense-kernel seconds."""
    events = [e for e in json.loads(trace_file.read_text())["traceEvents"] if e.get("ph") == "X"]
    rows = []
    for step in (e for e in events if e["name"].startswith("ProfilerStep")):
        lo, hi = step["ts"], step["ts"] + step["dur"]
        by_thread: dict[int, list[tuple[float, float]]] = defaultdict(list)
        for e in events:
            if e.get("cat") == "cpu_op" and e["name"] in DENSE_KERNELS and lo <= e["ts"] < hi:
                by_thread[e["tid"]].append((e["ts"], e["ts"] + e["dur"]))
        kernels = sum(_covered(iv) for iv in by_thread.values())
        rows.append({"step_s": step["dur"] / 1e6, "kernel_s": kernels / 1e6})
    return rows


def _profiled_step(model: str, precision: str, warmup: int, steps: int) -> list[dict[str, float]]:
    """Step and dense-kernel seconds of each profiled step of one one-rank run."""
    with tempfile.TemporaryDirectory(prefix="bench-bounds-") as tmp:
        run_dir = Path(tmp) / "run"
        step_times(
            [f"model={model}", "parallelism=single", f"precision={PRECISIONS[precision]}", "data=synthetic",
             f"training.steps={warmup + steps}", "training.local_batch_size=2", "training.seq_len=256",
             "training.activation_checkpoint=none", "training.compile=false", "metrics.tensorboard=false",
             "metrics.console=false", "profiling.enabled=true", f"profiling.start_step={warmup + 1}",
             f"profiling.steps={steps}"],
            run_dir, ranks=1)
        return [r for f in sorted((run_dir / "profile").glob("rank0.*.json")) for r in kernel_share(f)]


def kernels(args: argparse.Namespace) -> None:
    precisions = args.precisions.split(",")
    for model in args.models.split(","):
        samples: dict[str, list[dict[str, float]]] = defaultdict(list)
        for _ in range(args.rounds):  # precisions interleaved, so drift hits both alike
            for precision in precisions:
                samples[precision] += _profiled_step(model, precision, args.warmup, args.steps)
        measured: dict[str, tuple[float, float]] = {}
        for precision in precisions:
            step = statistics.median(r["step_s"] for r in samples[precision])
            kernel = statistics.median(r["kernel_s"] for r in samples[precision])
            measured[precision] = (step, kernel)
            print(json.dumps({
                "model": model, "precision": precision, "tokens_per_s": round(512 / step, 1),
                "step_s": round(step, 3), "kernel_s": round(kernel, 3),
                "kernel_share": round(kernel / step, 3), "ceiling": round(step / kernel, 2),
                "steps_sampled": len(samples[precision]), "load_avg": round(os.getloadavg()[0], 2),
            }), flush=True)
        if {"fp32", "bf16"} <= measured.keys():
            (fp32_step, _), (bf16_step, bf16_kernel) = measured["fp32"], measured["bf16"]
            # bf16 can beat fp32 by at most fp32's step over bf16's kernels alone.
            print(json.dumps({"model": model, "bf16_over_fp32": round(fp32_step / bf16_step, 2),
                              "bf16_over_fp32_ceiling": round(fp32_step / bf16_kernel, 2)}), flush=True)


# name -> (batch, heads, kv heads, seq, q/k head dim, v head dim) of the debug flavors
ATTENTION_SHAPES = {
    "qwen3": (2, 16, 8, 256, 128, 128),
    "llama4": (2, 16, 16, 256, 16, 16),
    "deepseek_v3": (2, 16, 16, 256, 192, 128),
    "llama4 @ seq 1024": (1, 16, 16, 1024, 16, 16),
    "qwen3 @ seq 1024": (1, 16, 8, 1024, 128, 128),
}


def _attention_ms(shape: tuple[int, ...], dtype, upcast: bool = False, repeats: int = 7) -> float:
    """Median ms of causal SDPA forward + backward on ``shape`` in ``dtype``."""
    import time

    import torch
    import torch.nn.functional as F

    batch, heads, kv_heads, seq, qk_dim, v_dim = shape
    q = torch.randn(batch, heads, seq, qk_dim, dtype=dtype, requires_grad=True)
    k = torch.randn(batch, kv_heads, seq, qk_dim, dtype=dtype, requires_grad=True)
    v = torch.randn(batch, kv_heads, seq, v_dim, dtype=dtype, requires_grad=True)
    grad = torch.randn(batch, heads, seq, v_dim, dtype=dtype)

    def step() -> None:
        qq, kk, vv = (t.float() for t in (q, k, v)) if upcast else (q, k, v)
        out = F.scaled_dot_product_attention(qq, kk, vv, is_causal=True, enable_gqa=heads != kv_heads)
        out.to(dtype).backward(grad)

    times = []
    for i in range(repeats + 2):
        start = time.perf_counter()
        step()
        if i >= 2:  # two warm-up calls
            times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def kernel_dtypes(args: argparse.Namespace) -> None:
    import torch

    from titan_plugins.train.peak import measure_matmul_tflops

    torch.set_num_threads(args.threads)
    for n in (512, 1024, 2048):
        fp32, bf16 = (measure_matmul_tflops(dtype, seconds=1.0, n=n) for dtype in (torch.float32, torch.bfloat16))
        print(json.dumps({"kernel": "matmul", "n": n, "fp32_tflops": round(fp32, 3), "bf16_tflops": round(bf16, 3),
                          "bf16_over_fp32": round(bf16 / fp32, 2)}), flush=True)
    for name, shape in ATTENTION_SHAPES.items():
        fp32 = _attention_ms(shape, torch.float32)
        bf16 = _attention_ms(shape, torch.bfloat16)
        upcast = _attention_ms(shape, torch.bfloat16, upcast=True)
        print(json.dumps({"kernel": "sdpa fwd+bwd", "shape": name, "fp32_ms": round(fp32, 1),
                          "bf16_ms": round(bf16, 1), "bf16_upcast_ms": round(upcast, 1),
                          "bf16_over_fp32": round(fp32 / bf16, 2)}), flush=True)


def ranks(args: argparse.Namespace) -> None:
    common = [f"model={args.model}", "precision=fp32", "data=synthetic", f"training.steps={args.steps}",
              f"training.seq_len={args.seq}", "training.activation_checkpoint=none",
              "metrics.tensorboard=false", "metrics.console=false"]
    layouts = {
        "one_rank": (1, ["parallelism=single", f"training.local_batch_size={args.dp * args.local_batch}"]),
        args.preset: (args.ranks, [f"parallelism={args.preset}", f"training.local_batch_size={args.local_batch}"]),
    }
    steady: dict[str, list[float]] = defaultdict(list)
    for _ in range(args.rounds):
        for name, (world, extra) in layouts.items():
            with tempfile.TemporaryDirectory(prefix="bench-bounds-") as tmp:
                times = step_times(common + extra, Path(tmp) / "run", ranks=world)
            steady[name].append(steady_step_s(times, 2))
    one, multi = statistics.median(steady["one_rank"]), statistics.median(steady[args.preset])
    print(json.dumps({
        "model": args.model, "tokens_per_step": args.dp * args.local_batch * args.seq,
        "one_rank_step_s": round(one, 2), f"{args.preset}_step_s": round(multi, 2),
        "parallel_factor": round(multi / one, 2),
        "rounds": {k: [round(v, 2) for v in vs] for k, vs in steady.items()},
        "load_avg": round(os.getloadavg()[0], 2),
    }), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="part", required=True)
    k = sub.add_parser("kernels")
    k.add_argument("--models", default="qwen3,llama4,deepseek_v3")
    k.add_argument("--precisions", default="fp32,bf16")
    k.add_argument("--warmup", type=int, default=3)
    k.add_argument("--steps", type=int, default=2)
    k.add_argument("--rounds", type=int, default=3)
    d = sub.add_parser("kernel-dtypes")
    d.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    r = sub.add_parser("ranks")
    r.add_argument("--model", default="deepseek_v3")
    r.add_argument("--preset", default="fsdp4_tp2_ep2")
    r.add_argument("--ranks", type=int, default=8)
    r.add_argument("--dp", type=int, default=4, help="data-parallel degree of --preset")
    r.add_argument("--local-batch", type=int, default=4)
    r.add_argument("--seq", type=int, default=128)
    r.add_argument("--steps", type=int, default=7)
    r.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    {"kernels": kernels, "kernel-dtypes": kernel_dtypes, "ranks": ranks}[args.part](args)


if __name__ == "__main__":
    sys.exit(main())
