"""Memory and speed of fine-tuning, side by side, in one run (issue 39): full
fine-tuning, LoRA and QLoRA on the project's model, each with the whole logits and
with the fused chunked loss, against transformers + peft LoRA and transformers + peft
over a bitsandbytes 4-bit base, on one Qwen3-0.6B-shaped random model on one process.

    python benchmarks/bench_memory.py --layers 28 --seq 512 --steps 3
    python benchmarks/bench_memory.py --layers 28 --seq 512 --steps 3 --ac

``--ac``: every case with activation checkpointing on each decoder layer (ours:
``training.activation_checkpoint=full``; transformers: ``gradient_checkpointing_enable``
with ``use_reentrant=False``), as QLoRA recipes run.

Every case runs in its own subprocess. Memory is the process's resident set: the
peak while training (``VmHWM`` reset once the model and optimizer are built, so it
covers the steps: weights, gradients, optimizer state, activations, logits) and the
peak of the whole process (building and loading too). The base weights come from one
Hugging Face folder the parent writes first (random, tied embeddings as the 0.6B's),
loaded by every case (``model.hf`` for ours, ``from_pretrained`` for transformers), so
quantizing cases quantize while loading. One step = forward, loss, backward, AdamW
step, zero_grad; the first step is not timed. Nothing is downloaded.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

OURS = ["wq", "wk", "wv", "wo", "w1", "w2", "w3"]
THEIRS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
CASES = ("full", "full_fused", "lora", "lora_fused", "qlora_fused", "peft", "peft_bnb4")
VOCAB = 151936


def _hwm_mib() -> float:
    return int(re.search(r"VmHWM:\s+(\d+)", Path("/proc/self/status").read_text()).group(1)) / 1024


def _reset_hwm() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # Linux: the peak RSS starts again from now


def _hf_config(layers: int):
    import transformers

    return transformers.Qwen3Config(hidden_size=1024, intermediate_size=3072, num_hidden_layers=layers,
                                    num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                                    vocab_size=VOCAB, tie_word_embeddings=True, max_position_embeddings=4096,
                                    eos_token_id=0)


def write_base(folder: Path, layers: int) -> None:
    import torch
    import transformers

    torch.manual_seed(0)
    transformers.Qwen3ForCausalLM(_hf_config(layers)).save_pretrained(folder)


def _ours(args, method: str, fused: bool):
    from titan_plugins.loss.fused import defer_head
    from titan_plugins.loss.token_loss import token_loss_sum
    from titan_plugins.model.optimizer import build_optimizer
    from titan_plugins.plugins import get_plugin_manager
    from titan_plugins.testing.model_parts import one_process_model
    from titan_plugins.train.api import prepare_job

    pm = get_plugin_manager()
    peft = [] if method == "full" else [f"peft={method}", f"peft.target_modules=[{','.join(OURS)}]",
                                        f"peft.rank={args.rank}", f"peft.alpha={2.0 * args.rank}"]
    ac = ["training.activation_checkpoint=full"] if args.ac else []
    spec, job, _ = prepare_job(["model=qwen3", f"model.hf={args.base}", "model.attn_backend=sdpa",
                                "data.name=synthetic", f"training.seq_len={args.seq}",
                                f"precision.weight_dtype={args.dtype}", *peft, *ac], pm)
    model = one_process_model(spec, job, args.base)
    if args.ac:
        from titan_plugins.distributed.activation_checkpoint import apply_activation_checkpointing

        apply_activation_checkpointing(model, job)
    if fused:
        defer_head(model, spec.pipeline.last_stage_modules[-1], chunk_size=args.chunk, vocab_parallel=False)
    opt = build_optimizer(model, job.training)
    return model, opt, lambda x, y: token_loss_sum(model(x), y) / y.numel()


def _peft(args, bnb4: bool):
    import peft
    import torch
    import torch.nn.functional as F
    import transformers

    kw = {}
    if bnb4:  # QLoRA as the bitsandbytes recipe: NF4, double quantization, fp32 compute here
        kw = {"quantization_config": transformers.BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.float32), "device_map": "cpu"}
    model = transformers.Qwen3ForCausalLM.from_pretrained(args.base, attn_implementation="sdpa", **kw)
    if args.ac:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model = peft.get_peft_model(model, peft.LoraConfig(r=args.rank, lora_alpha=2 * args.rank, target_modules=THEIRS))
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.1)

    def loss(x, y):
        logits = model(input_ids=x).logits
        return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())

    return model, opt, loss


def case(args) -> dict:
    import torch

    torch.set_num_threads(args.threads)
    name = args.case
    if name.startswith("peft"):
        model, opt, loss_fn = _peft(args, bnb4=name == "peft_bnb4")
    else:
        model, opt, loss_fn = _ours(args, name.split("_")[0], fused=name.endswith("_fused"))
    model.train()
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, VOCAB, (args.batch, args.seq + 1), generator=g)
    setup_peak = _hwm_mib()
    _reset_hwm()
    times, losses = [], []
    for step in range(args.steps + 1):
        t0 = time.perf_counter()
        loss = loss_fn(x[:, :-1], x[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
        if step:
            times.append(time.perf_counter() - t0)
    step_s = sum(times) / len(times)
    return {
        "case": name,
        "trainable": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "train_peak_mib": _hwm_mib(),
        "setup_peak_mib": setup_peak,
        # ru_maxrss survives exec (it would show the parent's), VmHWM does not
        "process_peak_mib": max(setup_peak, _hwm_mib()),
        "step_s": step_s,
        "tokens_per_s": args.batch * args.seq / step_s,
        "first_loss": losses[0],
    }


def _load() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def run_cases(script: str, names: list[str], args: list[str]) -> dict[str, dict]:
    """Each case in its own process (``script --case NAME *args``), one after the other,
    its last stdout line a JSON row; the load average printed around them. A failed case
    is one line and left out."""
    rows = {}
    print(f"load average before: {_load()}", flush=True)
    for name in names:
        run = subprocess.run([sys.executable, script, "--case", name, *args], capture_output=True, text=True)
        if run.returncode:
            print(f"{name}: failed: {(run.stderr.strip().splitlines() or ['?'])[-1]}", flush=True)
            continue
        rows[name] = json.loads(run.stdout.strip().splitlines()[-1])
        print(json.dumps(rows[name]), flush=True)
    print(f"load average after: {_load()}", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=28)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--chunk", type=int, default=256, help="training.loss_chunk_size of the fused cases")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--ac", action="store_true", help="activation checkpointing on every case")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                   help="precision.weight_dtype of our cases (bench_fit.py); transformers' stay fp32")
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--case", choices=CASES)
    p.add_argument("--base", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.case:
        print(json.dumps(case(args)))
        return 0
    tmp = Path(tempfile.mkdtemp(prefix="bench-memory-"))
    try:
        write_base(tmp / "base", args.layers)
        passed = [f"--{k}={v}" for k, v in vars(args).items() if k not in ("case", "base", "cases", "ac")]
        passed += [f"--base={tmp / 'base'}"] + (["--ac"] if args.ac else [])
        rows = run_cases(__file__, args.cases.split(","), passed)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    full = rows.get("full")
    print("\n| case | trainable | train peak MiB | / full | process peak MiB | tokens/s | / peft |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, r in rows.items():
        ratio = r["train_peak_mib"] / full["train_peak_mib"] if full else float("nan")
        speed = r["tokens_per_s"] / rows["peft"]["tokens_per_s"] if "peft" in rows else float("nan")
        print(f"| {name} | {r['trainable']:,} | {r['train_peak_mib']:.0f} | {ratio:.2f} | "
              f"{r['process_peak_mib']:.0f} | {r['tokens_per_s']:.0f} | {speed:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
