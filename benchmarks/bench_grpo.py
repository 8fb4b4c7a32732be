"""The cost of a GRPO step (issue 47, item 8), side by side: ``objective=grpo``
(``rollout=native``: the live policy samples with the KV cache, no second model)
against TRL 1.16's ``GRPOTrainer`` with transformers' ``generate`` (``use_vllm=False``)
on the same model, prompts, group size and lengths, on this CPU.

    python benchmarks/bench_grpo.py [--prompts 4] [--generations 8] [--length 32] [--layers 4] [--dim 256]
                                    [--steps 5] [--rounds 3] [--threads 2]

One random Qwen3 Hugging Face folder (written first: default initialisation, so nearly
every completion runs to ``--length``; the vocabulary, EOS / padding and chat template
of the shipped ChatML tokenizer, which the folder carries) is loaded by both sides, fp32,
one process, ``--threads`` torch threads (2: the whole of an idle 2-core box). The
prompts are the first ``--prompts`` rows of the shipped arithmetic task
(``data=prompts``' default file), written to a file both read, so every step covers all
of them on both sides: ``--prompts`` x ``--generations`` completions of at most
``--length`` tokens, temperature 1.0, top-k / top-p off, the ``accuracy`` reward (the
project's function, TRL's signature, handed to TRL as is), beta 0 (no reference), DAPO
loss, one microbatch (ours ``training.local_batch_size`` = the prompts; TRL's
``per_device_train_batch_size`` = prompts x generations), AdamW. TRL's
``gradient_checkpointing`` (on by its GRPOConfig's default) is turned off, as ours does
not checkpoint (``--trl-checkpointing`` keeps TRL's default). The TRL case checks first
that its chat-template rendering of the prompts gives the same ids as ours (as a set:
each side shuffles the prompts its own way).

- ``ours``: ``titan_plugins.train.api.run`` (``titan-run model=qwen3 model.hf=FOLDER
  objective=grpo data=prompts ...``), one rank; per step ``time/generation_s`` (sampling),
  ``time/scoring_s`` (decoding and the rewards) and ``step_time_s`` from metrics.jsonl,
  generated tokens (the completions' lengths) from completions.jsonl.
- ``trl``: ``GRPOTrainer.train()``; per step, measured by wrapping its methods:
  generation = ``_generate_single_turn`` (left-padding, ``model.generate``, cutting at
  EOS), scoring = ``_calculate_rewards``, the step = a callback's ``on_step_begin`` to
  ``on_step_end`` (generation, scoring, the rest of ``_generate_and_score_completions``,
  forward, loss, backward, clipping, AdamW).
- update = step - generation - scoring on both sides (ours: advantages, rows, forward,
  loss, backward, AdamW; TRL: the same plus its prompt rendering and decoding, which
  ours does in the data loader and in scoring).

Each side runs ``--steps`` + 1 steps per run (the first not counted) in its own process,
``--rounds`` times, alternating which side goes first, so machine load hits both alike;
the load average is printed around each round. Per side: the medians over every counted
step of the step and its split, generated tokens per second of generation, step time
per generated token, and the training peak resident set (``VmHWM`` reset after the first
step, read after the last; ``rss_start`` the resident set at that reset: libraries,
weights, optimizer state), the median over the runs. Sampling differs between the two
(different generators), so the generated tokens per step are compared (equal work:
the same number of completions; the tokens within a few percent, else a warning).
The JSON goes to benchmarks/results/grpo_vs_trl.json, a markdown table to stdout.
Nothing is downloaded.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_memory import _hwm_mib, _load, _reset_hwm, run_cases  # noqa: E402

from titan_plugins.hookspecs import hookimpl  # noqa: E402  (light: pluggy only)

RESULT = Path(__file__).resolve().parent / "results" / "grpo_vs_trl.json"
PEAK_FILE = "bench_grpo_peak.json"
EOS = 2047  # the shipped ChatML tokenizer's <|im_end|>: its EOS and padding


def _rss_mib() -> float:
    return int(re.search(r"VmRSS:\s+(\d+)", Path("/proc/self/status").read_text()).group(1)) / 1024


# ------------------------------------------------------------------ the peak of our rank
# This module is also a titan-plugins plugin (``extra_plugins=["bench_grpo"]``): in our
# rank it resets the peak resident set after step 1 and writes it after the last step.
_RANK: dict[str, object] = {}


@hookimpl
def titan_on_train_start(job_config, run_dir: str, rank: int) -> None:
    _RANK["run_dir"] = run_dir


@hookimpl
def titan_on_step_end(step: int, metrics: dict, job_config, rank: int) -> None:
    if step == 1:
        _RANK["rss_start"] = _rss_mib()
        _reset_hwm()


@hookimpl
def titan_on_train_end(step: int, metrics: dict, job_config, rank: int) -> None:
    if "run_dir" in _RANK and rank == 0:
        peak = {"rss_start_mib": _RANK.get("rss_start"), "train_peak_mib": _hwm_mib()}
        (Path(str(_RANK["run_dir"])) / PEAK_FILE).write_text(json.dumps(peak))


# ------------------------------------------------------------------ setup
def write_base(folder: Path, args) -> None:
    import torch
    import transformers

    from titan_plugins.data.tokenizer import ASSETS

    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(vocab_size=2048, hidden_size=args.dim, intermediate_size=3 * args.dim,
                                   num_hidden_layers=args.layers, num_attention_heads=args.dim // 64,
                                   num_key_value_heads=max(1, args.dim // 128), head_dim=64,
                                   max_position_embeddings=256, tie_word_embeddings=False,
                                   eos_token_id=EOS, pad_token_id=EOS, bos_token_id=None, rope_theta=10000.0)
    transformers.Qwen3ForCausalLM(cfg).save_pretrained(folder)
    shutil.copyfile(ASSETS / "chat_tokenizer" / "tokenizer.json", folder / "tokenizer.json")
    config = json.loads((ASSETS / "chat_tokenizer" / "tokenizer_config.json").read_text())
    # transformers would load a qwen3 folder's tokenizer as Qwen2Tokenizer (its own pre-tokenizer)
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


def write_prompts(path: Path, n: int) -> None:
    from titan_plugins.data.chat_source import ASSETS

    lines = (ASSETS / "arithmetic.jsonl").read_text().splitlines()[:n]
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")


def _rows(args) -> list[dict]:
    return [json.loads(line) for line in Path(args.data).read_text().splitlines()]


def _our_prompt_ids(args) -> list[list[int]]:
    from titan_plugins.data.prompt_source import PromptDataset
    from titan_plugins.data.tokenizer import Tokenizer
    from titan_plugins.testing.grpo import grpo_job

    job = grpo_job(args.data, args.base, seq_len=args.seq)
    dataset = PromptDataset(job.data, Tokenizer.load(args.base), dp_rank=0, dp_world=1, seq_len=args.seq, seed=0)
    return [list(dataset.prompt_row(p).ids) for p in range(args.prompts)]


# ------------------------------------------------------------------ the two sides
def _ours(args) -> dict:
    from titan_plugins.train.api import run

    run_dir = Path(args.work) / f"ours-{args.round}"
    overrides = ["model=qwen3", f"model.hf={args.base}", "model.attn_backend=sdpa", "objective=grpo", "data=prompts",
                 f"data.path={args.data}", f"data.tokenizer={args.base}", f"training.seq_len={args.seq}",
                 f"training.local_batch_size={args.prompts}", f"training.steps={args.steps + 1}",
                 "training.warmup_steps=0", "training.lr=1e-6", f"objective.num_generations={args.generations}",
                 f"objective.max_completion_length={args.length}", "objective.temperature=1.0",
                 "objective.reward_funcs=[accuracy]", "metrics.console=false", "metrics.tensorboard=false"]
    result = run(overrides, run_dir=run_dir, extra_plugins=["bench_grpo"], timeout=1800,
                 env={"OMP_NUM_THREADS": str(args.threads), "TITAN_WARM_START": "0"})
    if result.returncode:
        raise SystemExit(f"titan-run failed: {result.error}\n{result.stderr[-2000:]}")
    metrics = {int(r["step"]): r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
               if "step_time_s" in r}
    tokens: dict[int, int] = {}
    completions: dict[int, int] = {}
    for r in map(json.loads, (run_dir / "completions.jsonl").read_text().splitlines()):
        tokens[r["step"]] = tokens.get(r["step"], 0) + int(r["length"])
        completions[r["step"]] = completions.get(r["step"], 0) + 1
    steps = sorted(metrics)
    peak = json.loads((run_dir / PEAK_FILE).read_text())
    return {"step_s": [metrics[s]["step_time_s"] for s in steps],
            "generation_s": [metrics[s]["time/generation_s"] for s in steps],
            "scoring_s": [metrics[s]["time/scoring_s"] for s in steps],
            "tokens": [tokens[s] for s in steps], "completions": [completions[s] for s in steps],
            "prompt_ids": _our_prompt_ids(args), **peak}


def _trl(args) -> dict:
    import datasets
    import torch
    import transformers
    import trl

    from titan_plugins.rewards.registry import load_rewards

    torch.set_num_threads(args.threads)
    ((name, reward),) = load_rewards(["accuracy"], {})

    def accuracy(prompts, completions, completion_ids, **columns):  # the project's function, TRL's signature
        return reward(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns)

    model = transformers.AutoModelForCausalLM.from_pretrained(args.base, attn_implementation="sdpa",
                                                              dtype=torch.float32)
    config = trl.GRPOConfig(output_dir=str(Path(args.work) / f"trl-{args.round}"), report_to=[], use_cpu=True,
                            bf16=False, per_device_train_batch_size=args.prompts * args.generations,
                            num_generations=args.generations, max_completion_length=args.length, temperature=1.0,
                            top_p=1.0, top_k=0, beta=0.0, loss_type="dapo", learning_rate=1e-6,
                            lr_scheduler_type="constant", max_steps=args.steps + 1, logging_steps=10_000,
                            save_strategy="no", disable_tqdm=True, seed=0,
                            gradient_checkpointing=args.trl_checkpointing)
    trainer = trl.GRPOTrainer(model=model, reward_funcs=[accuracy], args=config,
                              processing_class=transformers.AutoTokenizer.from_pretrained(args.base),
                              train_dataset=datasets.Dataset.from_list(_rows(args)))
    rows = _rows(args)
    prompt_ids = [list(i) for i in trainer._tokenize_prompts([r["prompt"] for r in rows])[0]]
    torch.set_num_threads(args.threads)  # in case a library set its own

    out: dict[str, list] = {k: [] for k in ("step_s", "generation_s", "scoring_s", "tokens", "completions")}
    now: dict[str, float] = {}

    def timed(fn, key, count=False):
        def wrapper(*a, **kw):
            t0 = time.perf_counter()
            result = fn(*a, **kw)
            now[key] = now.get(key, 0.0) + time.perf_counter() - t0
            if count:
                now["tokens"] = now.get("tokens", 0) + sum(len(c) for c in result[0])
                now["completions"] = now.get("completions", 0) + len(result[0])
            return result
        return wrapper

    trainer._generate_single_turn = timed(trainer._generate_single_turn, "generation_s", count=True)
    trainer._calculate_rewards = timed(trainer._calculate_rewards, "scoring_s")
    peak: dict[str, float] = {}

    class Clock(transformers.TrainerCallback):
        def on_step_begin(self, *a, **kw):
            now.clear()
            now["t0"] = time.perf_counter()

        def on_step_end(self, state_args, state, control, **kw):
            out["step_s"].append(time.perf_counter() - now["t0"])
            for key in ("generation_s", "scoring_s", "tokens", "completions"):
                out[key].append(now.get(key, 0))
            if state.global_step == 1:
                peak["rss_start_mib"] = _rss_mib()
                _reset_hwm()

    trainer.add_callback(Clock())
    trainer.train()
    return {**out, "prompt_ids": prompt_ids, "rss_start_mib": peak["rss_start_mib"], "train_peak_mib": _hwm_mib()}


def case(args) -> dict:
    row = _ours(args) if args.case == "ours" else _trl(args)
    row["case"] = args.case
    row["round"] = args.round
    return row


# ------------------------------------------------------------------ the report
def _median(runs: list[dict], key: str) -> float:
    return statistics.median(v for r in runs for v in r[key][1:])  # step 1 not counted


def summarize(runs: list[dict]) -> dict:
    counted = [(s, g, t) for r in runs for s, g, t in zip(r["step_s"][1:], r["generation_s"][1:], r["tokens"][1:])]
    return {
        "runs": len(runs),
        "steps_counted": len(counted),
        "step_s": _median(runs, "step_s"),
        "generation_s": _median(runs, "generation_s"),
        "scoring_s": _median(runs, "scoring_s"),
        "update_s": statistics.median(s - g - c for r in runs for s, g, c in
                                      zip(r["step_s"][1:], r["generation_s"][1:], r["scoring_s"][1:])),
        "tokens_per_step": statistics.median(t for _, _, t in counted),
        "completions_per_step": statistics.median(c for r in runs for c in r["completions"][1:]),
        "generation_tokens_per_s": statistics.median(t / g for _, g, t in counted),
        "step_ms_per_token": statistics.median(1000 * s / t for s, _, t in counted),
        "rss_start_mib": statistics.median(r["rss_start_mib"] for r in runs),
        "train_peak_mib": statistics.median(r["train_peak_mib"] for r in runs),
    }


def _table(summary: dict) -> str:
    ours, trl = summary["ours"], summary["trl"]
    rows = [("step s (median)", "step_s", "{:.3f}"), ("generation s", "generation_s", "{:.3f}"),
            ("scoring s", "scoring_s", "{:.4f}"), ("update s (step - generation - scoring)", "update_s", "{:.3f}"),
            ("completions per step", "completions_per_step", "{:.0f}"),
            ("generated tokens per step", "tokens_per_step", "{:.0f}"),
            ("generated tokens / s (generation)", "generation_tokens_per_s", "{:.0f}"),
            ("step ms per generated token", "step_ms_per_token", "{:.2f}"),
            ("RSS at start MiB", "rss_start_mib", "{:.0f}"), ("train peak RSS MiB", "train_peak_mib", "{:.0f}")]
    lines = ["| | ours | TRL 1.16 | ours / TRL |", "|---|---:|---:|---:|"]
    for label, key, fmt in rows:
        ratio = ours[key] / trl[key] if trl[key] else float("nan")
        lines.append(f"| {label} | {fmt.format(ours[key])} | {fmt.format(trl[key])} | {ratio:.2f} |")
    lines.append(f"| train peak - start MiB | {ours['train_peak_mib'] - ours['rss_start_mib']:.0f} "
                 f"| {trl['train_peak_mib'] - trl['rss_start_mib']:.0f} | |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompts", type=int, default=4, help="prompts per step (the first of the arithmetic task)")
    p.add_argument("--generations", type=int, default=8, help="completions per prompt (num_generations)")
    p.add_argument("--length", type=int, default=32, help="max_completion_length")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dim", type=int, default=256, help="hidden size (heads of 64; MLP 3x)")
    p.add_argument("--steps", type=int, default=5, help="counted steps per run (one more runs first)")
    p.add_argument("--rounds", type=int, default=3, help="runs per side, alternated")
    p.add_argument("--threads", type=int, default=2, help="torch threads (2: an idle 2-core box)")
    p.add_argument("--trl-checkpointing", action="store_true", help="TRL's default gradient_checkpointing=True")
    p.add_argument("--out", default=str(RESULT), help="the JSON result ('' for none)")
    p.add_argument("--case", choices=("ours", "trl"))
    p.add_argument("--round", type=int, default=0, help=argparse.SUPPRESS)
    for hidden in ("base", "data", "work", "seq"):
        p.add_argument(f"--{hidden}", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.case:
        args.seq = int(args.seq)
        print(json.dumps(case(args)))
        return 0
    tmp = Path(tempfile.mkdtemp(prefix="bench-grpo-"))
    loads = [_load()]
    runs: dict[str, list[dict]] = {"ours": [], "trl": []}
    try:
        write_base(tmp / "base", args)
        write_prompts(tmp / "prompts.jsonl", args.prompts)
        seq = args.length + 64  # room for a rendered prompt (~15 tokens here) and the completion
        fixed = {"base": tmp / "base", "data": tmp / "prompts.jsonl", "work": tmp, "seq": seq}
        passed = [f"--{k}={v}" for k, v in vars(args).items()
                  if k not in ("case", "round", "out", "trl_checkpointing", *fixed) and v is not None]
        passed += [f"--{k}={v}" for k, v in fixed.items()] + (["--trl-checkpointing"] if args.trl_checkpointing
                                                              else [])
        for k in range(args.rounds):
            order = ["ours", "trl"] if k % 2 == 0 else ["trl", "ours"]
            for name in order:  # one process per run; run_cases prints the load around it
                rows = run_cases(__file__, [name], [*passed, f"--round={k}"])
                if name not in rows:
                    raise SystemExit(f"{name}: the run failed (its line above)")
                runs[name].append(rows[name])
            loads.append(_load())
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    ours_ids, trl_ids = runs["ours"][0]["prompt_ids"], runs["trl"][0]["prompt_ids"]
    summary = {name: summarize(rs) for name, rs in runs.items()}
    o, t = summary["ours"], summary["trl"]
    checks = {"prompts_render_alike": sorted(ours_ids) == sorted(trl_ids),  # each side orders them its own way
              "same_completions_per_step": o["completions_per_step"] == t["completions_per_step"],
              "tokens_per_step_ratio": round(o["tokens_per_step"] / t["tokens_per_step"], 4)}
    if not checks["prompts_render_alike"]:
        print("warning: our prompt ids differ from TRL's rendering", flush=True)
    if not checks["same_completions_per_step"]:
        print("warning: the two sides generated different numbers of completions per step", flush=True)
    if abs(checks["tokens_per_step_ratio"] - 1) > 0.05:
        print(f"warning: generated tokens per step differ by more than 5% (ours / TRL "
              f"{checks['tokens_per_step_ratio']}): compare tokens/s and ms per token", flush=True)
    setup = {k: v for k, v in vars(args).items() if k in ("prompts", "generations", "length", "layers", "dim",
                                                           "steps", "rounds", "threads", "trl_checkpointing")}
    result = {"setup": {**setup, "temperature": 1.0, "reward": "accuracy", "beta": 0.0, "loss_type": "dapo",
                        "dtype": "float32", "trl": _version("trl"), "transformers": _version("transformers"),
                        "torch": _version("torch"), "cpus": os.cpu_count()},
              "load_average": loads, "checks": checks,
              "summary": {k: {kk: round(vv, 4) for kk, vv in v.items()} for k, v in summary.items()},
              "ratio_ours_over_trl": {k: round(o[k] / t[k], 3) for k in o if t[k]},
              "runs": {k: [{kk: vv for kk, vv in r.items() if kk != "prompt_ids"} for r in rs]
                       for k, rs in runs.items()}}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"\nload average (1, 5, 15 min) at the start and after each round: {' | '.join(loads)}")
    print(f"checks: {json.dumps(checks)}\n")
    print(_table(summary))
    return 0


def _version(name: str) -> str:
    from importlib.metadata import version

    return version(name)


if __name__ == "__main__":
    sys.exit(main())
