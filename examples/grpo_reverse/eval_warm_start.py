"""The accuracy of a checkpoint on the shipped reverse prompts, greedy and sampled.

    python examples/grpo_reverse/eval_warm_start.py CHECKPOINT [CHECKPOINT ...] [--prompts N] [--samples K]

Each prompt goes through the run's chat template (as ``data=prompts`` renders it), the
completion is scored by the shipped ``accuracy`` reward against the row's ``answer``.
All reverse prompts have the same length in tokens, so they decode as one batch.
"""

from __future__ import annotations

import argparse
import json

import torch

from titan_plugins.chat.prompting import chat_prompt, template_for
from titan_plugins.data.chat_source import ASSETS
from titan_plugins.generate.load import load_checkpoint
from titan_plugins.generate.sampling import SamplingConfig, generate
from titan_plugins.rewards.builtin import accuracy


def score(path: str, rows: list[dict], samples: int) -> dict[str, float]:
    loaded = load_checkpoint(path, torch.device("cpu"))
    template = template_for(loaded.job.data, None)
    ids, stop = [], None
    for r in rows:
        p, stop = chat_prompt(r["prompt"], template, loaded.tokenizer)
        ids.append(p)
    prompt = torch.tensor(ids)
    out = {}
    for name, temp, k in (("greedy", 0.0, 1), ("T=1", 1.0, samples)):
        cfg = SamplingConfig(max_new_tokens=8, temperature=temp, seed=0)
        cfg.eos_id = stop
        got = generate(loaded.model, prompt.repeat_interleave(k, 0), cfg).tolist()
        texts = [loaded.tokenizer.decode([t for t in g if t != stop]) for g in got]
        answers = [r["answer"] for r in rows for _ in range(k)]
        out[name] = sum(accuracy([], texts, got, answer=answers)) / len(texts)
        out[f"{name} e.g."] = f"{rows[0]['answer']!r} -> {texts[0]!r}"
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("checkpoints", nargs="+")
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--data", default="reverse.jsonl", help="a prompts file of the shipped assets")
    a = p.parse_args()
    with open(ASSETS / a.data) as f:
        rows = [json.loads(line) for line in f][: a.prompts]
    for c in a.checkpoints:
        print(json.dumps({"checkpoint": c, **score(c, rows, a.samples)}), flush=True)


if __name__ == "__main__":
    main()
