"""objective=grpo end to end (titan-run, one rank, rollout=native on a tiny Qwen3 and the
shipped arithmetic prompts): two steps log TRL's metrics and write completions.jsonl; a
run resumed from the step-1 checkpoint samples the same completions and trains bitwise
like the uninterrupted one; what GRPO cannot train is refused before launch in one line.
fsdp2 against one rank: tests/test_grpo_fsdp.py."""

from __future__ import annotations

import json
import shutil

import pytest

from titan_plugins.errors import ConfigError
from titan_plugins.train.api import run

pytest.importorskip("titan_qwen3")
pytestmark = pytest.mark.slow  # launched runs

TINY = ["model=qwen3", "model.n_layers=2", "model.dim=64", "model.n_heads=4", "model.n_kv_heads=2",
        "model.head_dim=16", "model.hidden_dim=128", "model.enable_weight_tying=false", "metrics.tensorboard=false",
        "metrics.console=false", "objective=grpo", "data=prompts", "training.seq_len=64",
        "objective.max_completion_length=12", "objective.num_generations=4", "training.local_batch_size=2",
        "training.warmup_steps=0", "training.lr=0.01",
        # a reward the random policy earns about half the time: the advantages are not all 0
        "objective.reward_funcs=[accuracy,format]", "objective.reward_weights=[1.0,0.5]",
        "+objective.reward_options.format.pattern='(?s)[a-z].*'"]
TRL_METRICS = ("reward", "reward_std", "rewards/accuracy/mean", "rewards/format/mean", "frac_reward_zero_std",
               "completions/mean_length", "completions/clipped_ratio", "entropy", "clip_ratio/low_mean",
               "clip_ratio/high_mean", "clip_ratio/region_mean")


def _records(run_dir, name="metrics.jsonl"):
    return [r for r in map(json.loads, (run_dir / name).read_text().splitlines()) if "step" in r]


def _go(tmp_path, name, *overrides):
    result = run([*TINY, *overrides], run_dir=tmp_path / name, timeout=300)
    assert result.returncode == 0, f"{name}: {result.error}\n{result.stderr[-3000:]}"
    return _records(tmp_path / name), _records(tmp_path / name, "completions.jsonl")


def test_two_native_steps_log_trls_metrics_and_resume_bitwise(tmp_path):
    common = ["training.steps=2", "checkpoint.enabled=true", "checkpoint.interval=1"]
    whole, whole_completions = _go(tmp_path, "whole", *common)
    for record in whole:
        assert all(key in record for key in TRL_METRICS), sorted(set(TRL_METRICS) - set(record))
        assert "kl" not in record  # beta 0: no reference
    assert [r["step"] for r in whole_completions] == [1] * 8 + [2] * 8  # 2 prompts x 4 per step
    first = whole_completions[0]
    assert set(first) >= {"prompt", "position", "completion", "rewards", "reward", "advantage", "truncated"}
    assert first["completion"][0]["role"] == "assistant" and set(first["rewards"]) == {"accuracy", "format"}
    assert 0 < whole[0]["rewards/format/mean"] < 1 and whole[0]["grad_norm"] > 0

    # A run stopped after step 1: its checkpoint (policy, optimizer, the prompts' position) in a fresh run dir.
    shutil.copytree(tmp_path / "whole" / "checkpoints" / "step-1", tmp_path / "resumed" / "checkpoints" / "step-1")
    resumed, resumed_completions = _go(tmp_path, "resumed", *common)
    assert [r["step"] for r in resumed] == [2]
    assert resumed_completions == whole_completions[8:]  # step 2 sampled anew after the resume: the same tokens
    keys = ("loss", "grad_norm", *TRL_METRICS)
    assert [resumed[0][k] for k in keys] == [whole[1][k] for k in keys]


@pytest.mark.parametrize("overrides, message", [
    (["data=chat_sample"], "objective.name=grpo samples completions of prompts, but data.name=chat_sample"),
    (["parallelism=pp2"], "parallelism.pp=2: objective.name=grpo decodes with the whole model on each rank"),
    (["objective.loss_type=sigmoid"], "objective.loss_type=sigmoid: expected one of grpo, dapo, dr_grpo, bnpo"),
    (["objective.scale_rewards=std"], "objective.scale_rewards=std: expected one of group, batch, none"),
    (["objective.importance_sampling_level=seq"], "objective.importance_sampling_level=seq: expected one of"),
    (["objective.reward_weights=[1.0]"], "objective.reward_weights=[1.0]: 1 weights for 2 rewards"),
    (["objective.reward_funcs=[acuracy,format]"], "'acuracy' is not a known reward; did you mean 'accuracy'?"),
    (["objective.num_generations=1"], "objective.num_generations=1 must be at least 2"),
    (["objective.max_completion_length=64"], "objective.max_completion_length=64 leaves no room for a prompt"),
    (["objective.max_completion_length=50"], "arithmetic.jsonl:"),  # a prompt and 50 new tokens: over seq_len
    (["objective.beta=0.1", "objective.precompute_ref=true"], "objective.precompute_ref=true: objective.name=grpo"),
    (["validation.enabled=true"], "validation.enabled=true: objective.name=grpo has no held-out loss"),
    (["rollout=file"], "rollout=file needs rollout.path=FILE"),
    (["objective=sft", "data=builtin", "rollout=file"], "rollout=file: objective.name=sft samples nothing"),
])
def test_what_grpo_cannot_train_is_one_line_before_launch(tmp_path, overrides, message):
    with pytest.raises(ConfigError) as err:
        run([*TINY, *overrides], run_dir=tmp_path / "refused", timeout=60)
    assert message in str(err.value) and "\n" not in str(err.value), str(err.value)
    assert not (tmp_path / "refused" / "metrics.jsonl").exists()
