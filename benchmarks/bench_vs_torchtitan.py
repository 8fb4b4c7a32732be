"""Steady-state tokens/s of TorchTitan 0.2.2's own trainer against ``titan-run``
on the same work, interleaved, one row per model x parallelism x precision.

    python benchmarks/bench_vs_torchtitan.py [--rows qwen3/single,deepseek_v3/ep2]
        [--precisions fp32,bf16] [--steps 12] [--warmup 4] [--rounds 1] [--out FILE]

Each row runs TorchTitan, then titan-run (``--rounds`` times, alternating), each as
its own job of ``ranks`` processes; a side's tokens/s is the global tokens of one
step divided by the median step time after ``--warmup`` steps (the median over
rounds of that), and ``ratio`` = titan-run / TorchTitan.

The same work on both sides:

- model: the ``debugmodel`` flavor of each (the plugins equal TorchTitan's definitions
  bit for bit in fp32: plugins/*/tests/*equivalence*);
- data: random token ids in the model's vocab (no tokenizer or files on either side),
  ``local_batch_size`` 2, ``seq_len`` 256, one microbatch per step;
- parallelism: the same degrees (``fsdp2`` = dp_shard 2; ``ep2`` = dp_shard 2 with
  ep 2 borrowed from it, TorchTitan's dp2ep and our ``fsdp2_ep2``);
- activation checkpointing off (TorchTitan ``activation_checkpoint.mode=none``, ours
  ``training.activation_checkpoint=none``), compile off on both;
- AdamW: TorchTitan's ``optimizer.implementation`` is set to the implementation our
  ``build_optimizer`` picks on CPU (:data:`TT_OPTIMIZER_IMPL`), gradient clipping at
  1.0 on both, weights and optimizer state fp32 on both;
- precision: ``fp32`` rows: TorchTitan ``mixed_precision_param=float32``, ours
  ``precision=fp32``; ``bf16`` rows: TorchTitan's default ``mixed_precision_param=
  bfloat16`` (FSDP's MixedPrecisionPolicy with FSDP, ``torch.autocast`` on one rank,
  and plain fp32 under TP without FSDP, which TorchTitan does not support), ours
  ``precision=bf16_mixed`` (FSDP's policy with FSDP, the CPU compute path without);
- MoE experts: TorchTitan's grouped-mm path always casts the experts to bf16, so
  fp32 rows run its per-expert loop (its only fp32 expert path) and bf16 rows its
  grouped mm; ours uses ``torch._grouped_mm`` in the row's precision;
- threads: ``OMP_NUM_THREADS`` = cores // ranks (at least 1) for both;
- logging: each side's default (TorchTitan logs every 10 steps, ours every step), no
  TensorBoard, no checkpoints, no validation.

TorchTitan is patched at run time only, in the worker process (``_patch_torchtitan``):

1. device: ``torchtitan.tools.utils`` picks ``cuda`` when no accelerator exists; it is
   pointed at ``cpu`` with a small device module (set_device, memory stats as zeros)
   before the rest of torchtitan binds it, so the process group is gloo (TorchTitan's
   own device-to-backend map) and the model materializes on the CPU;
2. ``torch.histc`` on integer inputs: the MoE router counts tokens with histc on int64,
   which CPU lacks; integers are counted as float32 (exact here) and returned in the
   input's dtype, as CUDA's histc does;
3. ``torchtitan.models.moe.kernels`` imports triton (a GPU compiler) at module level;
   it is imported against a stand-in ``triton`` whose ``jit`` is the identity, and its
   ``generate_permute_indices`` (EP token permutation) is called with ``use_cpu=True``,
   TorchTitan's own CPU reference; the stand-in leaves ``sys.modules`` right after;
4. ``datasets``: imported at module level for the C4 loaders; a stand-in raises if called;
5. tokenizer and dataloader: the wheel ships neither the test tokenizer nor the C4 test
   files; the train spec's ``build_tokenizer_fn`` is None and ``build_dataloader_fn``
   yields random ``({"input": x}, labels)`` batches of the configured shape;
6. MoE kernel knob (fp32 rows): ``moe_args.use_grouped_mm = False`` on the flavor's args;
7. gloo has no PREMUL_SUM, which FSDP uses for a custom gradient divide factor (TorchTitan
   sets one under EP): after its ``parallelize_fn``, every FSDP module gets
   ``set_force_sum_reduction_for_comms(True)`` (sum, then the same division locally),
   which is what ours does on every backend;
8. tied embeddings under FSDP (qwen3 rows in ``UNTIED``): TorchTitan 0.2.2 puts the tied
   embedding and output in two FSDP groups, which torch 2.13 rejects ("shared with a
   parameter already managed by another FSDP group"); both sides run untied there;
9. SDPA under TP: the CPU attention kernel has no DTensor sharding strategy; TorchTitan's
   SDPA wrapper gets the local (head-sharded) q/k/v and wraps the result back with q's
   placements, as ours hands its kernel local tensors.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _titan_run import steady_step_s, step_times, threads_per_rank  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SEQ_LEN, LOCAL_BATCH, VOCAB = 256, 2, 2048
# The AdamW implementation ours uses on CPU (titan_plugins/model/optimizer.py).
TT_OPTIMIZER_IMPL = "fused"

# row -> (ranks, our parallelism preset, TorchTitan degrees, data-parallel degree)
LAYOUTS = {
    "single": (1, "single", {}, 1),
    "fsdp2": (2, "fsdp2", {"data_parallel_shard_degree": 2}, 2),
    "tp2": (2, "tp2", {"data_parallel_shard_degree": 1, "tensor_parallel_degree": 2}, 1),
    "fsdp2_tp2": (4, "fsdp2_tp2", {"data_parallel_shard_degree": 2, "tensor_parallel_degree": 2}, 2),
    "ep2": (2, "fsdp2_ep2", {"data_parallel_shard_degree": 2, "expert_parallel_degree": 2}, 2),
}
ROWS = [
    "qwen3/single", "qwen3/fsdp2", "qwen3/tp2", "qwen3/fsdp2_tp2",
    "deepseek_v3/single", "deepseek_v3/ep2", "llama4/single", "llama4/ep2",
    "llama3/single", "llama3/fsdp2", "llama3/tp2", "llama3/fsdp2_tp2",
]
PRECISIONS = {"fp32": ("float32", "fp32"), "bf16": ("bfloat16", "bf16_mixed")}
# TorchTitan 0.2.2 shards qwen3's tied embedding and output in two FSDP groups, which
# torch 2.13 refuses; these rows untie the weights on both sides (patch 8).
UNTIED = {"qwen3/fsdp2", "qwen3/fsdp2_tp2"}


# ---------------------------------------------------------------- TorchTitan side
def _patch_torchtitan(use_grouped_mm: bool, untie: bool) -> None:
    """The run-time patches listed in the module docstring (this process only)."""
    import dataclasses
    import importlib.machinery
    import importlib.util
    import types
    from collections import defaultdict

    import torch

    class _CPUDevice:  # patch 1
        @staticmethod
        def set_device(_device): ...
        @staticmethod
        def current_device(): return 0
        @staticmethod
        def synchronize(*_a): ...
        @staticmethod
        def get_device_name(*_a): return "cpu"
        @staticmethod
        def get_device_properties(*_a): return types.SimpleNamespace(total_memory=1)
        @staticmethod
        def reset_peak_memory_stats(*_a): ...
        @staticmethod
        def empty_cache(): ...
        @staticmethod
        def memory_stats(*_a): return defaultdict(int)

    original_histc = torch.histc  # patch 2

    def histc(input, *args, **kwargs):
        if input.dtype.is_floating_point:
            return original_histc(input, *args, **kwargs)
        return original_histc(input.float(), *args, **kwargs).to(input.dtype)

    torch.histc = histc

    def stub(name: str, **attrs) -> types.ModuleType:
        module = types.ModuleType(name)
        module.__spec__ = importlib.machinery.ModuleSpec(name, None)
        module.__dict__.update(attrs)
        return module

    def unavailable(*_a, **_k):
        raise RuntimeError("stubbed out in the CPU benchmark")

    # patch 3: build torchtitan.models.moe.kernels from its source with a stand-in
    # triton bound in its namespace only (torch itself must keep seeing no triton).
    fake_triton = stub("triton", jit=lambda fn=None, **_k: fn if fn else (lambda f: f))
    fake_triton.language = stub("triton.language", constexpr=int)
    root = Path(importlib.util.find_spec("torchtitan").submodule_search_locations[0])
    source = (root / "models" / "moe" / "kernels.py").read_text()
    source = source.replace("import triton\nimport triton.language as tl\n", "")
    kernels = stub("torchtitan.models.moe.kernels", triton=fake_triton, tl=fake_triton.language)
    exec(compile(source, str(root / "models" / "moe" / "kernels.py"), "exec"), kernels.__dict__)
    sys.modules[kernels.__name__] = kernels
    sys.modules.setdefault("datasets", stub("datasets", Dataset=object, load_dataset=unavailable))  # patch 4
    sys.modules.setdefault("datasets.distributed", stub("datasets.distributed", split_dataset_by_node=unavailable))
    # patch 1: torchtitan.tools.utils asks torch._utils for the device at import time and
    # the rest of torchtitan binds the answer by name, so answer "cpu" during the import.
    saved = torch._utils._get_available_device_type, torch._utils._get_device_module
    torch._utils._get_available_device_type = lambda: "cpu"
    torch._utils._get_device_module = lambda kind=None: _CPUDevice if kind in (None, "cpu") else saved[1](kind)
    try:
        import torchtitan.models.moe.utils as moe_utils
        import torchtitan.train  # noqa: F401
        from torchtitan.tools import utils as tt_utils
    finally:
        torch._utils._get_available_device_type, torch._utils._get_device_module = saved
    assert tt_utils.device_type == "cpu", tt_utils.device_type

    import torchtitan.models.attention as tt_attention
    from torch.distributed.tensor import DTensor

    sdpa_forward = tt_attention.ScaledDotProductAttentionWrapper.forward

    def local_sdpa(self, q, k, v, **kwargs):  # patch 9
        if not isinstance(q, DTensor):
            return sdpa_forward(self, q, k, v, **kwargs)
        out = sdpa_forward(self, q.to_local(), k.to_local(), v.to_local(), **kwargs)
        return DTensor.from_local(out, q.device_mesh, q.placements, run_check=False)

    tt_attention.ScaledDotProductAttentionWrapper.forward = local_sdpa

    generate_on_gpu = kernels.generate_permute_indices

    def generate_permute_indices(*args, **kwargs):
        return generate_on_gpu(*args, **{**kwargs, "use_cpu": True})

    moe_utils.generate_permute_indices = generate_permute_indices

    import torchtitan.protocols.train_spec as train_spec_module
    import torchtitan.train as tt_train

    def synthetic_loader(dp_world_size, dp_rank, tokenizer, job_config):  # patch 5
        gen = torch.Generator().manual_seed(1000 + dp_rank)
        shape = (job_config.training.local_batch_size, job_config.training.seq_len)

        class Loader:
            def __iter__(self):
                while True:
                    tokens = torch.randint(0, VOCAB, (shape[0], shape[1] + 1), generator=gen)
                    yield {"input": tokens[:, :-1]}, tokens[:, 1:]

            def state_dict(self):
                return {}

            def load_state_dict(self, _sd):
                pass

        return Loader()

    original_get = train_spec_module.get_train_spec

    def get_train_spec(name):
        spec = original_get(name)
        for args in spec.model_args.values():  # patch 6
            moe_args = getattr(args, "moe_args", None)
            if moe_args is not None:
                moe_args.use_grouped_mm = use_grouped_mm
            if untie and hasattr(args, "enable_weight_tying"):  # patch 8
                args.enable_weight_tying = False
        parallelize = spec.parallelize_fn

        def parallelize_fn(model, *args, **kwargs):  # patch 7
            from torch.distributed.fsdp import FSDPModule

            model = parallelize(model, *args, **kwargs)
            for module in model.modules():
                if isinstance(module, FSDPModule):
                    module.set_force_sum_reduction_for_comms(True)
            return model

        return dataclasses.replace(
            spec, build_tokenizer_fn=None, build_dataloader_fn=synthetic_loader, parallelize_fn=parallelize_fn
        )

    train_spec_module.get_train_spec = get_train_spec
    tt_train.train_spec_module = train_spec_module


def torchtitan_worker(payload: str) -> None:
    """One rank of TorchTitan's trainer; rank 0 writes its step times to ``out``."""
    job = json.loads(payload)
    _patch_torchtitan(job["use_grouped_mm"], job["untie"])
    import torch
    from torchtitan.config import ConfigManager
    from torchtitan.tools.logging import init_logger
    from torchtitan.train import Trainer

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    init_logger()
    config = ConfigManager().parse_args(job["args"])
    times: list[float] = []
    original = Trainer.train_step

    def timed(self, data_iterator):
        t0 = time.perf_counter()
        original(self, data_iterator)
        times.append(time.perf_counter() - t0)

    Trainer.train_step = timed
    trainer = Trainer(config)
    try:
        trainer.train()
    finally:
        trainer.close()
    if int(os.environ.get("RANK", "0")) == 0:
        Path(job["out"]).write_text(json.dumps(times))
    torch.distributed.destroy_process_group()


def run_torchtitan(model: str, layout: str, precision: str, steps: int, tmp: Path) -> list[float]:
    ranks, _, degrees, _ = LAYOUTS[layout]
    tt_dtype, _ = PRECISIONS[precision]
    args = [
        "--model.name", model, "--model.flavor", "debugmodel",
        "--training.seq_len", str(SEQ_LEN), "--training.local_batch_size", str(LOCAL_BATCH),
        "--training.steps", str(steps), "--training.mixed_precision_param", tt_dtype,
        "--training.max_norm", "1.0", "--activation_checkpoint.mode", "none",
        "--optimizer.implementation", TT_OPTIMIZER_IMPL, "--job.dump_folder", str(tmp / "tt"),
        "--parallelism.data_parallel_shard_degree", "1",
    ]
    for key, value in degrees.items():
        args += [f"--parallelism.{key}", str(value)]
    out = tmp / "tt_times.json"
    payload = json.dumps({"args": args, "out": str(out), "use_grouped_mm": precision != "fp32",
                          "untie": f"{model}/{layout}" in UNTIED})
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
           f"--nproc-per-node={ranks}", __file__, "--torchtitan-worker", payload]
    proc = subprocess.run(cmd, env=_env(ranks), capture_output=True, text=True, timeout=900)
    if proc.returncode != 0 or not out.is_file():
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-60:])
        raise RuntimeError(f"TorchTitan {model}/{layout}/{precision} failed:\n{tail}")
    return json.loads(out.read_text())


# ------------------------------------------------------------------ titan-run side
def run_titan(model: str, layout: str, precision: str, steps: int, tmp: Path) -> list[float]:
    ranks, preset, _, _ = LAYOUTS[layout]
    _, ours = PRECISIONS[precision]
    return step_times(
        [f"model={model}", f"parallelism={preset}", f"precision={ours}", "data=synthetic",
         f"data.vocab_size={VOCAB}", f"training.steps={steps}", f"training.local_batch_size={LOCAL_BATCH}",
         f"training.seq_len={SEQ_LEN}", "training.max_norm=1.0", "training.activation_checkpoint=none",
         "training.compile=false", "metrics.tensorboard=false", "metrics.console=false",
         *(["model.enable_weight_tying=false"] if f"{model}/{layout}" in UNTIED else [])],
        tmp / "titan", ranks=ranks, timeout=900,
    )


# ----------------------------------------------------------------------- driver
def _env(ranks: int) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": str(threads_per_rank(ranks)), "PYTHONPATH": str(ROOT)}


def steady_tokens_per_s(times: list[float], warmup: int, tokens_per_step: int) -> float:
    return tokens_per_step / steady_step_s(times, warmup)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default=",".join(ROWS), help="comma list of model/layout")
    parser.add_argument("--precisions", default="fp32,bf16")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=4, help="steps left out of the median")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--verbose", action="store_true", help="print every step time")
    parser.add_argument("--out", default=None, help="append the table to this file")
    args = parser.parse_args()
    if args.steps <= args.warmup:
        raise SystemExit(f"--steps={args.steps} must exceed --warmup={args.warmup}")
    rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    for row in rows:
        if row not in ROWS:
            raise SystemExit(f"--rows: {row!r} is not one of {', '.join(ROWS)}")
    load_before = os.getloadavg()
    lines = ["| row | precision | ranks | TorchTitan tok/s | titan-run tok/s | ratio |",
             "| --- | --- | --- | --- | --- | --- |"]
    ratios = []
    for precision in [p.strip() for p in args.precisions.split(",")]:
        for row in rows:
            model, layout = row.split("/")
            ranks, _, _, dp = LAYOUTS[layout]
            tokens = LOCAL_BATCH * SEQ_LEN * dp
            tt, ours = [], []
            try:
                for _ in range(args.rounds):
                    for runner, rates in ((run_torchtitan, tt), (run_titan, ours)):
                        with tempfile.TemporaryDirectory() as tmp:
                            times = runner(model, layout, precision, args.steps, Path(tmp))
                        rates.append(steady_tokens_per_s(times, args.warmup, tokens))
                        if args.verbose:
                            print(f"  {runner.__name__}: step s {[round(t, 2) for t in times]}", flush=True)
            except (RuntimeError, subprocess.TimeoutExpired) as exc:
                print(exc, flush=True)
                reason = [ln.strip() for ln in str(exc).splitlines() if "Error" in ln] or ["?"]
                lines.append(f"| {row} | {precision} | {ranks} | failed: {reason[-1][:120]} | | |")
                continue
            a, b = statistics.median(tt), statistics.median(ours)
            ratios.append(b / a)
            line = f"| {row} | {precision} | {ranks} | {a:.0f} | {b:.0f} | {b / a:.2f} |"
            lines.append(line)
            print(line, f"(rounds: tt {[round(v) for v in tt]}, ours {[round(v) for v in ours]})", flush=True)
    geomean = statistics.geometric_mean(ratios) if ratios else float("nan")
    load_after = os.getloadavg()
    command = "python benchmarks/bench_vs_torchtitan.py " + " ".join(sys.argv[1:])
    report = "\n".join([
        f"$ {command}",
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; cores {os.cpu_count()}; "
        f"load average before {load_before[0]:.1f}, after {load_after[0]:.1f}; steps {args.steps}, "
        f"warm-up {args.warmup}, rounds {args.rounds}",
        *lines, f"geomean ratio {geomean:.2f}", "",
    ])
    print(report)
    if args.out:
        with open(args.out, "a") as fh:
            fh.write(report + "\n")


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--torchtitan-worker":
        torchtitan_worker(sys.argv[2])
    else:
        main()
