"""The GPU check behind ``scripts/gpu_check.sh``: a few steps of every first-party
model on this machine's GPUs, with the plan's memory next to the measured one.

Per model: the debug flavor and one mid-size shape that fits one GPU (the real
width, a few layers), eager and compiled, a few steps each. Each row prints tokens/s,
TFLOP/s per GPU, MFU against the device's dense bf16 peak (titan_plugins.train.peak)
and peak CUDA memory (rank 0, from the run's metrics.jsonl), then the plan of the same
config (``plan=true``, planned in this process) and measured / planned peak memory.
With two or more GPUs it adds FSDP/TP/EP presets that fit.

Runs without FSDP use ``precision=bf16_compute``: ``bf16_mixed`` is FSDP's MixedPrecisionPolicy,
which a run without FSDP does not apply (it would compute in fp32). Presets with FSDP
run ``bf16_mixed``. ``--precision`` overrides both. Without CUDA it prints one line and
exits 0.

    scripts/gpu_check.sh [--quick] [--models qwen3,llama4] [--steps 8] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

MODELS = ("deepseek_v3", "qwen3", "llama4", "llama3")
SEQ_LEN = 2048

# One shape per model that fits one 80 GB GPU in fp32 weights + AdamW (planned 36-50 GiB
# at seq 2048, batch 2): the real width, fewer layers (llama4: fewer experts too).
MID: dict[str, tuple[str, list[str]]] = {
    "qwen3": ("8B/4 layers", ["model.flavor=8B", "model.n_layers=4"]),
    "deepseek_v3": ("16B/4 layers", ["model.flavor=16B", "model.n_layers=4"]),
    "llama4": ("17bx16e/2 layers/2 experts", ["model.flavor=17bx16e", "model.n_layers=2",
                                             "model.moe.num_experts=2"]),
    # Llama 3.1 8B's width (TorchTitan's published throughput/MFU model), 4 of its 32 layers.
    "llama3": ("8B/4 layers", ["model.flavor=8B", "model.n_layers=4"]),
}
# Presets per model for several GPUs: (GPUs needed, preset); debug flavor only.
MULTI: dict[str, list[tuple[int, str]]] = {
    "qwen3": [(2, "fsdp2"), (2, "tp2"), (4, "fsdp2_tp2")],
    "deepseek_v3": [(2, "fsdp2_ep2"), (4, "fsdp2_tp2_ep2")],
    "llama4": [(2, "fsdp2_ep2"), (4, "fsdp2_tp2_ep2")],
    "llama3": [(2, "fsdp2"), (2, "tp2"), (4, "fsdp2_tp2")],
}


@dataclass
class Row:
    model: str
    shape: str  # "debugmodel" or MID's label
    parallelism: str
    world: int
    compile: bool
    precision: str
    overrides: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        mode = "compiled" if self.compile else "eager"
        slug = self.shape.split("/")[0]
        return f"{self.model}-{slug}-{self.parallelism}-{mode}"

    def args(self, steps: int) -> list[str]:
        batch = 4 if self.shape == "debugmodel" else 2
        return [f"model={self.model}", *self.overrides, f"parallelism={self.parallelism}",
                f"precision={self.precision}", f"training.steps={steps}", f"training.seq_len={SEQ_LEN}",
                f"training.local_batch_size={batch}", f"training.compile={str(self.compile).lower()}",
                "training.warmup_steps=1", "metrics.tensorboard=false", "checkpoint.enabled=false"]


def build_rows(n_gpus: int, models: tuple[str, ...] = MODELS, *, quick: bool = False,
               precision: str | None = None) -> list[Row]:
    """What to run on ``n_gpus``: per model, debug and mid shapes on one GPU in eager and
    compiled mode (``quick``: debug eager + mid compiled), then the presets that fit."""
    rows: list[Row] = []
    single = precision or "bf16_compute"
    for model in models:
        shapes = [("debugmodel", [])] + [(MID[model][0], MID[model][1])]
        for shape, overrides in shapes:
            modes = [shape != "debugmodel"] if quick else [False, True]
            rows += [Row(model, shape, "single", 1, c, single, overrides) for c in modes]
    for model in models:
        rows += [Row(model, "debugmodel", preset, world, False,
                     precision or ("bf16_mixed" if "fsdp" in preset else "bf16_compute"))
                 for world, preset in MULTI[model] if world <= n_gpus]
    return rows


def summarize_metrics(path: Path, warmup: int) -> dict[str, float] | None:
    """Median tokens/s and TFLOP/s over the steps after ``warmup`` (compile and
    allocator warm-up), and the largest peak memory, from ``metrics.jsonl``."""
    if not path.is_file():
        return None
    recs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    steps = [r for r in recs if "step" in r and "loss" in r]
    if not steps:
        return None
    steady = steps[warmup:] or steps[-1:]
    return {
        "steps": len(steps),
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in steady),
        "tflops": statistics.median(r["tflops"] for r in steady),
        "memory_gib": max(r["memory_gib"] for r in steps),
        "loss": steps[-1]["loss"],
    }


def format_row(row: Row, got: dict[str, float] | None, planned_gib: float | None, peak_bf16: float | None,
               error: str | None = None) -> str:
    head = f"{row.name:<44} {row.precision:<13}"
    if got is None:
        return f"{head} FAILED: {error or 'no metrics'}"
    mfu = f"{100 * got['tflops'] / peak_bf16:5.1f}%" if peak_bf16 else "    -"
    ratio = f"{got['memory_gib'] / planned_gib:.2f}" if planned_gib else "-"
    plan = f"{planned_gib:7.2f}" if planned_gib else "      -"
    return (f"{head} tok/s {got['tokens_per_s']:>10,.0f} | TFLOP/s {got['tflops']:7.2f} | MFU {mfu} | "
            f"mem {got['memory_gib']:6.2f} GiB | plan {plan} GiB | measured/plan {ratio} | "
            f"loss {got['loss']:.3f}")


def planned_peak_gib(args: list[str], device_gib: float) -> float:
    """The plan's peak memory per rank for the same config, planned in this process."""
    from titan_plugins.plan.planner import GIB, make_plan
    from titan_plugins.plugins import get_plugin_manager
    from titan_plugins.train.api import prepare_job

    pm = get_plugin_manager(strict=True)
    spec, job, _ = prepare_job([*args, "plan.enabled=true", f"plan.device_memory_gb={device_gib:.1f}"], pm)
    return make_plan(spec, job, pm).peak.peak_bytes / GIB


def _device() -> tuple[str, int, float]:
    import torch

    props = torch.cuda.get_device_properties(0)
    return torch.cuda.get_device_name(0), torch.cuda.device_count(), props.total_memory / 2**30


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--quick", action="store_true", help="debug eager + mid compiled only")
    parser.add_argument("--precision", default=None, help="one precision preset for every row")
    parser.add_argument("--budget", type=float, default=450.0, help="seconds; later rows are skipped")
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds per run")
    parser.add_argument("--out", default=None, help="run directories (default outputs/gpu_check/<time>)")
    parser.add_argument("--plan-only", type=int, metavar="GPUS", default=None,
                        help="no runs, no CUDA needed: the planned peak of each row for GPUS GPUs of 80 GiB")
    opts = parser.parse_args(argv)
    models = tuple(m.strip() for m in opts.models.split(",") if m.strip())
    if opts.plan_only:
        for row in build_rows(opts.plan_only, models, quick=opts.quick, precision=opts.precision):
            print(f"{row.name:<44} {row.precision:<13} plan {planned_peak_gib(row.args(opts.steps), 80.0):7.2f} GiB",
                  flush=True)
        return 0

    import torch

    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device visible (torch "
              f"{torch.__version__}); skipped", flush=True)
        return 0
    from titan_plugins.errors import TitanError
    from titan_plugins.train.api import run
    from titan_plugins.train.peak import peak_tflops_for_name

    name, n_gpus, mem_gib = _device()
    peak = peak_tflops_for_name(name, "bf16")
    out = Path(opts.out or f"outputs/gpu_check/{time.strftime('%Y%m%d-%H%M%S')}")
    rows = build_rows(n_gpus, models, quick=opts.quick, precision=opts.precision)
    print(f"gpu_check: {n_gpus} x {name} ({mem_gib:.0f} GiB), dense bf16 peak "
          f"{peak if peak else 'unknown'} TFLOP/s, torch {torch.__version__}, seq {SEQ_LEN}, "
          f"{opts.steps} steps per run, {len(rows)} runs", flush=True)
    start, ok = time.perf_counter(), 0
    for row in rows:
        if time.perf_counter() - start > opts.budget:
            print(f"{row.name:<44} skipped: over the {opts.budget:.0f} s budget", flush=True)
            continue
        args = row.args(opts.steps)
        try:
            planned = planned_peak_gib(args, mem_gib)
        except Exception as exc:  # a plan that fails is reported, the run still goes
            planned = None
            print(f"{row.name:<44} plan failed: {type(exc).__name__}: {exc}", flush=True)
        if planned is not None and planned > 0.92 * mem_gib:
            print(f"{row.name:<44} skipped: planned {planned:.1f} GiB > this GPU's {mem_gib:.0f} GiB", flush=True)
            continue
        try:
            result = run(args, run_dir=out / row.name, timeout=opts.timeout)
            error = result.error if not result.ok else None
        except TitanError as exc:
            error = str(exc)
        got = None if error else summarize_metrics(out / row.name / "metrics.jsonl",
                                                   warmup=3 if row.compile else 2)
        ok += got is not None
        print(format_row(row, got, planned, peak, error), flush=True)
    print(f"gpu_check: {ok}/{len(rows)} runs ok in {time.perf_counter() - start:.0f} s; "
          f"run directories under {out}", flush=True)
    return 0 if ok == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
