"""``model=hf`` (transformers' modeling code) against the first-party plugin on the same
Hugging Face folder and layout: tokens/s and training-peak RSS, side by side (issue 38).

    python benchmarks/bench_hf_backend.py [--families qwen3,llama3] [--layouts single,fsdp2]
        [--steps 8] [--warmup 3] [--rounds 2]

The parent writes one random folder per family with transformers' ``save_pretrained``
(``Qwen3ForCausalLM`` / ``LlamaForCausalLM``, untied, dim 512, 4 layers, 8 heads / 4 KV
heads of 64, MLP 1536, vocab 8192; 21 M parameters: a one-process step of batch 2 x
seq 512 takes about 0.55 s on two quiet CPU threads). Every case is one ``titan-run`` of
that folder (``model.hf``) with random tokens, fp32, AC and compile off,
``OMP_NUM_THREADS`` = cores // ranks: the
first-party plugin (``model=qwen3`` / ``model=llama3``) and ``model=hf``, interleaved
(each round runs every layout of a family on both sides, the side that goes first
alternating per round). A side's tokens/s is the global tokens of one step over its
best step time (the fastest step after ``--warmup`` in any round: on a shared machine the
least disturbed one) and over its median step time (all rounds' steps after
``--warmup``); ratios are hf / first-party.

Memory is each rank's resident set, measured inside the real trainer by this module
loaded as a plugin in the ranks (``TITAN_PLUGINS_EXTRA``): ``titan_on_train_start``
(model built, weights loaded, optimizer created) notes the peak so far (setup peak) and
resets it (``/proc/self/clear_refs``); ``titan_on_train_end`` reads the peak over the
steps (train peak: weights, gradients, AdamW state, activations, logits, and the
process itself: torch, the plugin, transformers for ``model=hf``); ``train_growth_mib`` is
that peak less the resident set at the start of training (what the steps add). The largest
rank's is reported. Linux only. Nothing is downloaded.
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
from pathlib import Path

from titan_plugins import hookimpl

HERE = Path(__file__).resolve().parent
FAMILIES = {"qwen3": "Qwen3ForCausalLM", "llama3": "LlamaForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}
FIRST_PARTY = {"qwen3": "qwen3", "llama3": "llama3", "qwen3_moe": "qwen3"}  # the plugin that loads the folder
MODEL_TYPES = {"qwen3": "qwen3", "llama3": "llama", "qwen3_moe": "qwen3_moe"}
PRESETS = {"single": 1, "fsdp2": 2, "fsdp2_ep2": 2}
SEQ_LEN, LOCAL_BATCH, VOCAB = 512, 2, 8192
SHAPE = dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=4, head_dim=64, vocab_size=VOCAB, max_position_embeddings=2048,
             tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
# Qwen3-MoE's shape at the same width: 8 experts of hidden 512, top-2 (normalised), every layer MoE
MOE_SHAPE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=512, norm_topk_prob=True,
                 decoder_sparse_step=1, mlp_only_layers=[])


# ---------------------------------------------------------------- in the ranks (a plugin)
def _status_mib(field: str) -> float:
    return int(re.search(rf"{field}:\s+(\d+)", Path("/proc/self/status").read_text()).group(1)) / 1024


_state: dict[str, object] = {}


@hookimpl
def titan_on_train_start(job_config, run_dir: str, rank: int) -> None:
    _state.update(run_dir=run_dir, setup_peak_mib=_status_mib("VmHWM"), start_mib=_status_mib("VmRSS"))
    Path("/proc/self/clear_refs").write_text("5")  # Linux: the peak RSS starts again from now


@hookimpl
def titan_on_train_end(step: int, metrics: dict, job_config, rank: int) -> None:
    record = {"rank": rank, "setup_peak_mib": _state["setup_peak_mib"], "start_mib": _state["start_mib"],
              "train_peak_mib": _status_mib("VmHWM")}
    (Path(str(_state["run_dir"])) / f"bench_memory_rank{rank}.json").write_text(json.dumps(record))


# ---------------------------------------------------------------- the parent
def write_folder(family: str, folder: Path) -> None:
    import torch
    import transformers

    config = transformers.AutoConfig.for_model(MODEL_TYPES[family], **SHAPE,
                                               **(MOE_SHAPE if family == "qwen3_moe" else {}))
    config.architectures = [FAMILIES[family]]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # every weight matters (HF's init leaves near-zero weights)
        for name, p in model.named_parameters():
            p.normal_(1.0 if "norm" in name else 0.0, 0.02)
    model.save_pretrained(folder)


def run_case(model: str, folder: Path, layout: str, args, run_dir: Path) -> dict:
    from _titan_run import step_times

    ranks = PRESETS[layout]
    extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    times = step_times(
        [f"model={model}", f"model.hf={folder}", f"parallelism={layout}", "precision=fp32", "data=synthetic",
         f"data.vocab_size={VOCAB}", f"training.steps={args.steps}", f"training.local_batch_size={LOCAL_BATCH}",
         f"training.seq_len={SEQ_LEN}", "training.activation_checkpoint=none", "training.compile=false",
         "metrics.tensorboard=false", "metrics.console=false", "checkpoint.enabled=false"],
        run_dir, ranks=ranks,
        env={"TITAN_PLUGINS_EXTRA": "bench_hf_backend", "PYTHONPATH": os.pathsep.join([str(HERE), *extra])},
    )
    memory = [json.loads(p.read_text()) for p in sorted(run_dir.glob("bench_memory_rank*.json"))]
    return {"tokens": LOCAL_BATCH * SEQ_LEN * ranks, "steps_s": times[args.warmup:],
            "train_peak_mib": max(m["train_peak_mib"] for m in memory),
            "train_growth_mib": max(m["train_peak_mib"] - m["start_mib"] for m in memory),
            "setup_peak_mib": max(m["setup_peak_mib"] for m in memory)}


def _load() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--layouts", default=",".join(PRESETS))
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args(argv)
    families, layouts = args.families.split(","), args.layouts.split(",")
    tmp = Path(tempfile.mkdtemp(prefix="bench-hf-backend-"))
    rows: dict[tuple[str, str, str], list[dict]] = {}
    try:
        folders = {f: tmp / f / "folder" for f in families}
        for family, folder in folders.items():
            write_folder(family, folder)
        print(f"load average before: {_load()}", flush=True)
        for rnd in range(args.rounds):
            for family in families:
                for layout in layouts:
                    for side in ([FIRST_PARTY[family], "hf"] if rnd % 2 == 0 else ["hf", FIRST_PARTY[family]]):
                        r = run_case(side, folders[family], layout, args, tmp / family / f"{layout}-{side}-{rnd}")
                        rows.setdefault((family, layout, side), []).append(r)
                        print(json.dumps({"round": rnd, "family": family, "layout": layout, "model": side, **r}),
                              flush=True)
        print(f"load average after: {_load()}", flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print("\n| family | layout | best tok/s first-party | hf | hf / first-party | median tok/s first-party | hf "
          "| hf / first-party | train peak MiB first-party | hf | hf / first-party | growth MiB first-party | hf "
          "| hf / first-party |")
    print("|---|---|" + "---:|" * 12)
    for family in families:
        for layout in layouts:
            sides = rows[(family, layout, FIRST_PARTY[family])], rows[(family, layout, "hf")]
            steps = [[t for r in side for t in r["steps_s"]] for side in sides]
            tokens = sides[0][0]["tokens"]
            values = [[tokens / min(s) for s in steps], [tokens / statistics.median(s) for s in steps]]
            for key in ("train_peak_mib", "train_growth_mib"):
                values.append([statistics.median(r[key] for r in side) for side in sides])
            cells = [f"{first:.0f} | {hf:.0f} | {hf / first:.2f}" for first, hf in values]
            print(f"| {family} | {layout} | {' | '.join(cells)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
