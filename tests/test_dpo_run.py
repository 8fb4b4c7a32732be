"""objective=dpo end to end (titan-run), full fine-tuning: at initialisation the policy is
the reference (the frozen copy), so step 1's sigmoid loss is exactly ln 2 and every reward
0; fsdp2_tp2 equals one rank; a resumed run is bitwise; what DPO cannot train is refused
before launch. The LoRA run (ln 2, the preference learnt, export, generate) is
tests/test_dpo_export.py's."""

from __future__ import annotations

import json
import math

import pytest
import torch

from titan_plugins.errors import ConfigError
from titan_plugins.train.api import run

pytest.importorskip("titan_qwen3")

TINY = ["model=qwen3", "model.n_layers=2", "model.dim=64", "model.n_heads=4", "model.n_kv_heads=2",
        "model.head_dim=16", "model.hidden_dim=128", "model.enable_weight_tying=false",
        "metrics.tensorboard=false", "objective=dpo", "data=preference_sample", "training.seq_len=256",
        "training.warmup_steps=0", "training.decay=none"]
LN2 = torch.tensor(math.log(2), dtype=torch.float32).item()
REWARDS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins")


def _records(run_dir):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "step" in r]


def _go(tmp_path, name, *overrides):
    result = run([*TINY, *overrides], run_dir=tmp_path / name, timeout=300)
    assert result.returncode == 0, f"{name}: {result.error}\n{result.stderr[-3000:]}"
    return result, _records(tmp_path / name)


def test_full_fine_tuning_fsdp2_tp2_equals_one_rank(tmp_path):
    """The frozen reference copy sharded like the policy: step 1 is ln 2 on both, and
    the loss and rewards of three steps agree within the project's parity tolerance."""
    from titan_plugins.compare.tolerances import LOSS_PARITY

    seed_run = run([*TINY, "checkpoint.create_seed=true"], run_dir=tmp_path / "seed", timeout=300)
    assert seed_run.returncode == 0, seed_run.error  # one set of starting weights for both layouts
    seed = f"checkpoint.init_from={tmp_path / 'seed' / 'checkpoints' / 'seed'}"
    _, one = _go(tmp_path, "one", seed, "training.steps=3", "training.local_batch_size=4", "metrics.console=false")
    _, four = _go(tmp_path, "fsdp2_tp2", seed, "parallelism=fsdp2_tp2", "training.steps=3",
                  "training.local_batch_size=2", "metrics.console=false")
    assert one[0]["loss"] == LN2 and four[0]["loss"] == pytest.approx(LN2, abs=1e-6)
    for step, (a, b) in enumerate(zip(one, four), 1):
        assert LOSS_PARITY.allows(a["loss"], b["loss"], step), (step, a["loss"], b["loss"])
        for key in ("rewards/margins", "logps/chosen"):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-5), (step, key)


@pytest.mark.parametrize("overrides, message", [
    (["parallelism=pp2"], "parallelism.pp=2: objective.name=dpo needs"),
    (["data=builtin"], "objective.name=dpo trains on preference pairs, but data.name=builtin"),
    (["training.local_batch_size=3"], "training.local_batch_size=3 must be even"),
])
def test_what_dpo_cannot_train_is_one_line_before_launch(tmp_path, overrides, message):
    with pytest.raises(ConfigError) as err:
        run([*TINY, *overrides], run_dir=tmp_path / "refused", timeout=60)
    assert message in str(err.value) and "\n" not in str(err.value)
    assert not (tmp_path / "refused" / "metrics.jsonl").exists()


def test_a_resumed_dpo_run_trains_bitwise_like_an_uninterrupted_one(tmp_path):
    """Full fine-tuning: the checkpoint holds the policy, the data position is one integer,
    the reference is rebuilt from the same starting weights."""
    common = ["training.local_batch_size=4", "metrics.console=false", "checkpoint.enabled=true",
              "checkpoint.interval=2"]
    _, whole = _go(tmp_path, "whole", "training.steps=4", *common)
    _go(tmp_path, "resumed", "training.steps=2", *common)
    _, resumed = _go(tmp_path, "resumed", "training.steps=4", *common)
    after = [r for r in resumed if r["step"] > 2]
    assert [r["step"] for r in after] == [3, 4]
    for a, b in zip(whole[2:], after):
        assert (a["loss"], a["rewards/margins"], a["grad_norm"]) == (b["loss"], b["rewards/margins"], b["grad_norm"])
