"""The cost of a DPO step (issue 37.6), side by side in one run: step time against its
floor (two SFT forwards, one with gradient, and one backward on the same pairs) and
training-peak memory against TRL's ``DPOTrainer`` on the same model, pairs and batch.

    python benchmarks/bench_dpo.py [--pairs 8] [--seq 128] [--layers 4] [--dim 256] [--steps 5]

One random Qwen3 Hugging Face folder (written first; vocabulary of the shipped ChatML
tokenizer) is loaded by every case, fp32, one process each, ``--threads`` torch threads.
The batch is the first ``--pairs`` pairs of the shipped preference sample as TRL's
collator builds it (chosen rows then rejected rows, right-padded to ``--seq``); ours
reads the same ids (inputs ``ids[:, :-1]``, labels ``ids[:, 1:]`` on the completion,
as tests/test_dpo_trl.py does). Loss: sigmoid, beta 0.1; LoRA: rank 8, alpha 16 on the
attention projections; plain AdamW on the trainable parameters for every case.

- ``lora``, ``full``: what ``objective=dpo`` runs per microbatch
  (titan_plugins/objectives/step.py): the reference forward without gradient (LoRA: the
  same model, adapters off; full: a frozen copy), the policy forward, the DPO loss,
  backward, AdamW;
- ``full_precompute``: ``objective.precompute_ref=true``: the reference's per-row
  values computed once before training from the starting weights, no reference model;
- ``trl_*``: TRL's ``DPOTrainer.training_step`` (its own reference: PEFT adapters
  disabled, the copy it loads itself, or ``precompute_ref_log_probs=True``), then AdamW.

Per case: the training peak resident set (``VmHWM`` reset once the model, optimizer
and batch are built, so it covers the steps; ``rss_start`` is the resident set at that
reset: libraries and weights), the median DPO step (the first step is not timed), and
for ours the ratio DPO step / floor step, the two alternated step by step so machine
load hits both alike (the target is at most 1.1). Nothing is downloaded.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_memory import _hwm_mib, _reset_hwm, run_cases  # noqa: E402

CASES = ("lora", "full", "full_precompute", "trl_lora", "trl_full", "trl_full_precompute")
OURS = ["wq", "wk", "wv", "wo"]
THEIRS = ["q_proj", "k_proj", "v_proj", "o_proj"]


def _rss_mib() -> float:
    return int(re.search(r"VmRSS:\s+(\d+)", Path("/proc/self/status").read_text()).group(1)) / 1024


def _pairs(n: int) -> list[dict]:
    from titan_plugins.data.chat_source import ASSETS

    return [json.loads(line) for line in (ASSETS / "preference_sample.jsonl").read_text().splitlines()[:n]]


def write_base(folder: Path, args) -> None:
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(vocab_size=2048, hidden_size=args.dim, intermediate_size=3 * args.dim,
                                   num_hidden_layers=args.layers, num_attention_heads=args.dim // 64,
                                   num_key_value_heads=max(1, args.dim // 128), head_dim=64,
                                   max_position_embeddings=max(256, args.seq), tie_word_embeddings=False,
                                   eos_token_id=2047, pad_token_id=2047, rope_theta=10000.0)
    transformers.Qwen3ForCausalLM(cfg).save_pretrained(folder)


def _trl(args, mode: str):
    """TRL's DPOTrainer on the base folder and its collated batch of the first pairs."""
    import datasets
    import peft
    import torch
    import transformers
    import trl

    from titan_plugins.data.chat_source import CHAT_TOKENIZER

    policy = transformers.AutoModelForCausalLM.from_pretrained(args.base, attn_implementation="sdpa",
                                                               dtype=torch.float32)
    lora = peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=THEIRS) if mode == "lora" else None
    config = trl.DPOConfig(output_dir=str(Path(args.base).parent / f"trl-{mode}"), report_to=[], use_cpu=True,
                           bf16=False, per_device_train_batch_size=args.pairs, max_length=None,
                           pad_to_multiple_of=args.seq, beta=0.1, loss_type=["sigmoid"],
                           precompute_ref_log_probs=mode == "full_precompute")
    pairs = _pairs(args.pairs)
    trainer = trl.DPOTrainer(model=policy, ref_model=None, args=config, train_dataset=datasets.Dataset.from_list(pairs),
                             processing_class=transformers.AutoTokenizer.from_pretrained(CHAT_TOKENIZER),
                             peft_config=lora)
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(len(pairs))])
    if batch["input_ids"].shape[1] != args.seq:
        raise SystemExit(f"--seq={args.seq}: the pairs pad to {batch['input_ids'].shape[1]} tokens")
    return trainer, batch


def _ours(args, lora: bool):
    from titan_plugins.plugins import get_plugin_manager
    from titan_plugins.testing.model_parts import one_process_model
    from titan_plugins.train.api import prepare_job

    extra = ["peft=lora", f"peft.target_modules=[{','.join(OURS)}]", "peft.rank=8", "peft.alpha=16.0",
             "peft.dropout=0.0"] if lora else []
    spec, job, _ = prepare_job(["model=qwen3", f"model.hf={args.base}", "model.attn_backend=sdpa",
                                "data.name=synthetic", "data.vocab_size=2048", f"training.seq_len={args.seq}",
                                *extra], get_plugin_manager())
    return lambda: one_process_model(spec, job, args.base).train()


def _our_steps(args, mode: str):
    """``(dpo_step, floor_step, trainable, ids)`` of our objective on the saved batch."""
    import torch

    from titan_plugins.loss.token_loss import IGNORE_INDEX, count_tokens, token_loss_sum
    from titan_plugins.objectives.dpo import DPOObjective
    from titan_plugins.objectives.reference import adapters_off

    saved = torch.load(args.batch)
    ids, completion = saved["input_ids"], saved["completion_mask"]
    x, y = ids[:, :-1], ids[:, 1:].masked_fill(completion[:, 1:] == 0, IGNORE_INDEX)
    build = _ours(args, lora=mode == "lora")
    policy = build()
    frozen = build().requires_grad_(False) if mode == "full" else None
    objective = DPOObjective(SimpleNamespace(loss_type="sigmoid", beta=0.1, label_smoothing=0.0, simpo_gamma=0.5))
    scale = tuple(float(v) for v in objective.count(y))

    def reference() -> torch.Tensor:
        with torch.no_grad():
            if frozen is not None:
                return frozen(x)
            with adapters_off([policy]):
                return policy(x)

    stored = None
    if mode == "full_precompute":  # the first pass: the policy's values at its starting weights
        with torch.no_grad():
            stored = objective.reference_stats(policy(x), y)
    opt = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=1e-5)

    def dpo_step() -> float:
        ref = stored if stored is not None else objective.reference_stats(reference(), y)
        loss, _ = objective.loss(policy(x), y, scale=scale, reference=ref)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    def floor_step() -> float:
        if stored is None:
            reference()
        loss = token_loss_sum(policy(x), y) / count_tokens(y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    trainable = sum(p.numel() for p in policy.parameters() if p.requires_grad)
    return dpo_step, floor_step, trainable, ids


def _trl_steps(args, mode: str):
    import torch

    trainer, batch = _trl(args, mode)
    trainer.current_gradient_accumulation_steps = 1  # as Trainer.train sets it (no accumulation)
    model = trainer.model
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)

    def dpo_step() -> float:
        loss = trainer.training_step(model, batch)  # forward(s), loss, backward
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss)

    return dpo_step, None, sum(p.numel() for p in model.parameters() if p.requires_grad), batch["input_ids"]


def case(args) -> dict:
    import torch

    torch.set_num_threads(args.threads)
    theirs = args.case.startswith("trl_")
    mode = args.case.removeprefix("trl_")
    dpo_step, floor_step, trainable, ids = (_trl_steps if theirs else _our_steps)(args, mode)
    torch.set_num_threads(args.threads)  # in case a library set its own
    setup_peak, rss_start = _hwm_mib(), _rss_mib()
    _reset_hwm()
    times, losses = [], []
    for step in range(args.steps + 1):
        t0 = time.perf_counter()
        losses.append(dpo_step())
        if step:
            times.append(time.perf_counter() - t0)
    train_peak = _hwm_mib()
    row = {"case": args.case, "trainable": trainable, "batch": list(ids.shape), "ids_sum": int(ids.sum()),
           "rss_start_mib": round(rss_start, 1), "train_peak_mib": round(train_peak, 1),
           "setup_peak_mib": round(setup_peak, 1), "dpo_s": round(statistics.median(times), 4),
           "first_loss": round(losses[0], 6)}
    if floor_step is not None:  # alternated, after the memory steps
        alt: dict[str, list[float]] = {"dpo": [], "floor": []}
        for _ in range(args.steps):
            for name, fn in (("dpo", dpo_step), ("floor", floor_step)):
                t0 = time.perf_counter()
                fn()
                alt[name].append(time.perf_counter() - t0)
        dpo, floor = statistics.median(alt["dpo"]), statistics.median(alt["floor"])
        row.update(alt_dpo_s=round(dpo, 4), floor_s=round(floor, 4), dpo_over_floor=round(dpo / floor, 3))
    return row


def _table(rows: dict[str, dict]) -> None:
    print("\n| case | trainable | RSS at start MiB | train peak MiB | peak - start MiB | / TRL | DPO step s | / TRL "
          "| DPO / floor |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, r in rows.items():
        trl = rows.get(f"trl_{name}")
        grow = r["train_peak_mib"] - r["rss_start_mib"]
        mem = f"{r['train_peak_mib'] / trl['train_peak_mib']:.2f}" if trl else ""
        speed = f"{r['dpo_s'] / trl['dpo_s']:.2f}" if trl else ""
        floor = f"{r['dpo_over_floor']:.3f} ({r['alt_dpo_s']:.3f} / {r['floor_s']:.3f} s)" if "floor_s" in r else ""
        print(f"| {name} | {r['trainable']:,} | {r['rss_start_mib']:.0f} | {r['train_peak_mib']:.0f} | {grow:.0f} "
              f"| {mem} | {r['dpo_s']:.3f} | {speed} | {floor} |")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--pairs", type=int, default=8)
    p.add_argument("--seq", type=int, default=128, help="tokens per row (TRL's padded length)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dim", type=int, default=256, help="hidden size (heads of 64; MLP 3x)")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--case", choices=CASES)
    p.add_argument("--base", help=argparse.SUPPRESS)
    p.add_argument("--batch", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.case:
        print(json.dumps(case(args)))
        return 0
    tmp = Path(tempfile.mkdtemp(prefix="bench-dpo-"))
    try:
        import torch

        write_base(tmp / "base", args)
        args.base, args.batch = str(tmp / "base"), str(tmp / "batch.pt")
        _, batch = _trl(args, "full_precompute")  # TRL's tokenization and collation, saved for ours
        torch.save({k: batch[k] for k in ("input_ids", "completion_mask")}, args.batch)
        passed = [f"--{k}={v}" for k, v in vars(args).items() if k not in ("case", "cases")]
        rows = run_cases(__file__, args.cases.split(","), passed)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if len({(tuple(r["batch"]), r["ids_sum"]) for r in rows.values()}) > 1:
        print("warning: the cases did not see the same batch", flush=True)
    _table(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
