"""Per-block ``torch.compile`` against eager on the CPU: steady-state tokens/s and the
compile cost, interleaved, one row per model.

    python benchmarks/bench_compile.py [--models qwen3,llama4,deepseek_v3] [--ranks 1]
        [--precision fp32] [--steps 12] [--warmup 4] [--rounds 2]

Each row runs titan-run eager, then compiled (``training.compile=true``: each
transformer block compiled by inductor's C++ backend), ``--rounds`` times
alternating, on the ``debugmodel`` flavor with random tokens, batch 2 x seq 256,
activation checkpointing off, ``OMP_NUM_THREADS`` = cores // ranks. A side's
tokens/s is the tokens of one step over the median step time after ``--warmup``
steps (median over rounds); ``speedup`` = compiled / eager. ``first_step_s`` is the
first step's time (compile happens there) and ``compile_cost_s`` the compiled
first step minus the eager one. Every round compiles from a cold inductor cache
(a fresh ``TORCHINDUCTOR_CACHE_DIR``), as a new run on a new machine would.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _titan_run import steady_step_s, step_times  # noqa: E402

SEQ_LEN, LOCAL_BATCH = 256, 2
PRESETS = {1: "single", 2: "fsdp2"}


def run_once(model: str, ranks: int, precision: str, steps: int, compiled: bool, tmp: Path) -> list[float]:
    return step_times(
        [f"model={model}", f"parallelism={PRESETS[ranks]}", f"precision={precision}", "data=synthetic",
         f"training.steps={steps}", f"training.local_batch_size={LOCAL_BATCH}", f"training.seq_len={SEQ_LEN}",
         "training.activation_checkpoint=none", f"training.compile={str(compiled).lower()}",
         "metrics.tensorboard=false", "metrics.console=false"],
        tmp / ("compiled" if compiled else "eager"), ranks=ranks,
        env={"TORCHINDUCTOR_CACHE_DIR": str(tmp / "inductor")},
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="qwen3,llama4,deepseek_v3")
    parser.add_argument("--ranks", type=int, choices=sorted(PRESETS), default=1)
    parser.add_argument("--precision", default="fp32")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    tokens = LOCAL_BATCH * SEQ_LEN * args.ranks
    for model in args.models.split(","):
        rates: dict[bool, list[float]] = {False: [], True: []}
        first: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(args.rounds):
            for compiled in (False, True):
                with tempfile.TemporaryDirectory(prefix="bench-compile-") as tmp:
                    times = run_once(model, args.ranks, args.precision, args.steps, compiled, Path(tmp))
                rates[compiled].append(tokens / steady_step_s(times, args.warmup))
                first[compiled].append(times[0])
        eager, comp = statistics.median(rates[False]), statistics.median(rates[True])
        print(json.dumps({
            "model": model, "ranks": args.ranks, "precision": args.precision,
            "eager_tokens_per_s": round(eager, 1), "compiled_tokens_per_s": round(comp, 1),
            "speedup": round(comp / eager, 3),
            "first_step_s": {"eager": round(statistics.median(first[False]), 2),
                             "compiled": round(statistics.median(first[True]), 2)},
            "compile_cost_s": round(statistics.median(first[True]) - statistics.median(first[False]), 1),
            "load_avg": round(os.getloadavg()[0], 2),
        }), flush=True)


if __name__ == "__main__":
    sys.exit(main())
