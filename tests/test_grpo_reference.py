"""objective=grpo with beta > 0 (titan-run, one rank): the KL to the reference, through the
same reference machinery as DPO (LoRA: the base with the adapters off; full fine-tuning:
a frozen copy of the starting weights). At step 1 the policy is the reference, so ``kl``
is exactly 0; after an update it is positive. (Equality with TRL's KL term, each loss
type: tests/test_grpo_loss.py.)"""

from __future__ import annotations

import json

import pytest

from titan_plugins.train.api import run

pytest.importorskip("titan_qwen3")
pytestmark = pytest.mark.slow  # launched runs

TINY = ["model=qwen3", "model.n_layers=2", "model.dim=64", "model.n_heads=4", "model.n_kv_heads=2",
        "model.head_dim=16", "model.hidden_dim=128", "model.enable_weight_tying=false", "metrics.tensorboard=false",
        "metrics.console=false", "objective=grpo", "data=prompts", "training.seq_len=64",
        "objective.max_completion_length=8", "objective.num_generations=4", "training.local_batch_size=2",
        "training.warmup_steps=0", "training.lr=0.05", "training.steps=2", "objective.beta=0.04",
        "objective.reward_funcs=[format]", "+objective.reward_options.format.pattern='(?s)[a-z].*'"]


@pytest.mark.parametrize("peft", ["lora", "none"])
def test_the_kl_to_the_reference_starts_at_zero_and_grows(tmp_path, peft):
    result = run([*TINY, f"peft={peft}"], run_dir=tmp_path / peft, timeout=300)
    assert result.returncode == 0, f"{result.error}\n{result.stderr[-3000:]}"
    records = [r for r in map(json.loads, (tmp_path / peft / "metrics.jsonl").read_text().splitlines()) if "step" in r]
    assert records[0]["kl"] == 0.0 and records[0]["clip_ratio/region_mean"] == 0.0
    assert records[1]["kl"] > 0.0
