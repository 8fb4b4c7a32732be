"""LoRA against full fine-tuning, and our LoRA step against transformers + peft, on a
Qwen3-0.6B-shaped random model on one process (not a test; nothing downloaded).

    python benchmarks/bench_lora.py --layers 28 --seq 512 --steps 2
    python benchmarks/bench_lora.py --layers 28 --steps 2 --precision bf16   # bf16 base, bf16 compute

Each case runs in its own subprocess (peak RSS is per process): ``full`` (every
parameter trains, AdamW), ``lora`` (``peft=lora`` on the project's model: frozen base,
adapters on q/k/v/o and the MLP projections) and ``peft`` (transformers'
Qwen3ForCausalLM with ``peft.get_peft_model``, same shapes, batch, targets, rank and
AdamW). One step = forward, cross-entropy, backward, optimizer step, zero_grad; the
first step warms up and is not timed. ``--layers`` below 28 keeps a 2-core CPU run
short (the embedding, 151936 x 1024 tied, is the 0.6B model's). ``--precision bf16``
compares full fine-tuning under ``precision=bf16_mixed`` (fp32 master weights, bf16
compute) with LoRA over a bf16 frozen base (``precision.weight_dtype=bfloat16``).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

OURS = ["wq", "wk", "wv", "wo", "w1", "w2", "w3"]
THEIRS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _ours(args, lora: bool):
    import torch
    from omegaconf import OmegaConf

    from titan_plugins.config.hydra_glue import model_config
    from titan_plugins.model.optimizer import build_optimizer
    from titan_plugins.peft.lora import adapter_parameters, apply_lora, init_adapters
    from titan_plugins.plugins import get_plugin_manager
    from titan_plugins.train.api import prepare_job

    pm = get_plugin_manager()
    spec, job, _ = prepare_job(["model=qwen3", "model.flavor=0.6B", f"model.n_layers={args.layers}",
                                "model.attn_backend=sdpa", "data.name=synthetic",
                                f"training.seq_len={args.seq}"], pm)
    with torch.device("meta"):
        model = spec.load("build")(model_config(job.model, spec))
    if lora:
        apply_lora(model, OmegaConf.create({"target_modules": OURS, "rank": args.rank,
                                            "alpha": 2.0 * args.rank, "dropout": 0.0}))
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        model.init_weights()
    init_adapters(model, 0)
    if args.precision == "bf16":  # as the trainer on one rank: bf16 compute over fp32 master weights
        model.set_compute_dtype(torch.bfloat16)  # (precision=bf16_mixed); LoRA also keeps its frozen
        if lora:  # base in bf16 (precision.weight_dtype=bfloat16), the adapters fp32
            keep = {id(p) for p in adapter_parameters(model)}
            model._apply(lambda t: t.to(torch.bfloat16) if t.is_floating_point() and id(t) not in keep else t)
    opt = build_optimizer(model, job.training)
    return model, opt, lambda x: model(x)


def _peft(args):
    import peft
    import torch
    import transformers

    cfg = transformers.Qwen3Config(hidden_size=1024, intermediate_size=3072, num_hidden_layers=args.layers,
                                   num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                                   vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=4096)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(cfg)
    model = peft.get_peft_model(model, peft.LoraConfig(r=args.rank, lora_alpha=2 * args.rank, target_modules=THEIRS))
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.1, fused=True)
    return model, opt, lambda x: model(input_ids=x).logits


def case(args) -> dict:
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(args.threads)
    model, opt, forward = _peft(args) if args.case == "peft" else _ours(args, args.case == "lora")
    model.train()
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 151936, (args.batch, args.seq + 1), generator=g)
    times = []
    for step in range(args.steps + 1):
        t0 = time.perf_counter()
        logits = forward(x[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), x[:, 1:].flatten())
        loss.backward()
        if step == args.steps:  # the gradients, just before the last step consumes them
            grad_bytes = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters() if p.grad is not None)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step:
            times.append(time.perf_counter() - t0)
    state_bytes = sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values()
                      if torch.is_tensor(t))
    step_s = sum(times) / len(times)
    return {
        "case": args.case,
        "params": sum(p.numel() for p in model.parameters()),
        "trainable": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "optimizer_plus_grad_mib": (state_bytes + grad_bytes) / 2**20,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "step_s": step_s,
        "tokens_per_s": args.batch * args.seq / step_s,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--precision", choices=["fp32", "bf16"], default="fp32",
                   help="bf16: bf16 compute, full fine-tuning with fp32 master weights, LoRA with a bf16 "
                        "frozen base (our cases only)")
    p.add_argument("--case", choices=["full", "lora", "peft"])
    args = p.parse_args(argv)
    if args.case:
        print(json.dumps(case(args)))
        return 0
    rows = {}
    cases = ("full", "lora", "peft") if args.precision == "fp32" else ("full", "lora")
    for name in cases:
        cmd = [sys.executable, __file__, "--case", name] + [f"--{k}={v}" for k, v in vars(args).items()
                                                             if k != "case"]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        rows[name] = json.loads(out.strip().splitlines()[-1])
        print(json.dumps(rows[name]), flush=True)
    full, lora, ref = rows["full"], rows["lora"], rows.get("peft")
    print(f"LoRA peak RSS / full FT: {lora['peak_rss_mib'] / full['peak_rss_mib']:.2f} (target <= 0.45)")
    print(f"LoRA optimizer+grad / full FT: {lora['optimizer_plus_grad_mib'] / full['optimizer_plus_grad_mib']:.4f}")
    print(f"LoRA step / full FT step: {lora['step_s'] / full['step_s']:.2f}")
    if ref is None:
        return 0
    print(f"ours / transformers+peft tokens/s: {lora['tokens_per_s'] / ref['tokens_per_s']:.2f} (target >= 1.2); "
          f"peak RSS ours / theirs: {lora['peak_rss_mib'] / ref['peak_rss_mib']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
