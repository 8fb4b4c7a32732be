"""objective=dpo end to end (titan-run), full fine-tuning: at initialisation the policy is
the reference (the frozen copy), so step 1's sigmoid loss is exactly ln 2 and every reward
0; fsdp2_tp2 equals one rank; a resumed run is bitwise; what DPO cannot train is refused
before launch. The LoRA run (ln 2, the preference learnt, export, generate) is
tests/test_dpo_export.py's."""

from __future__ import annotations

import json

import pytest
import torch

from titan_plugins.errors import ConfigError
from titan_plugins.testing.dpo import LN2, REWARDS
from titan_plugins.train.api import run

pytest.importorskip("titan_qwen3")

TINY = ["model=qwen3", "model.n_layers=2", "model.dim=64", "model.n_heads=4", "model.n_kv_heads=2",
        "model.head_dim=16", "model.hidden_dim=128", "model.enable_weight_tying=false",
        "metrics.tensorboard=false", "objective=dpo", "data=preference_sample", "training.seq_len=256",
        "training.warmup_steps=0", "training.decay=none"]


def _records(run_dir):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "step" in r]


def _go(tmp_path, name, *overrides):
    result = run([*TINY, *overrides], run_dir=tmp_path / name, timeout=300)
    assert result.returncode == 0, f"{name}: {result.error}\n{result.stderr[-3000:]}"
    return result, _records(tmp_path / name)


def test_full_fine_tuning_fsdp2_tp2_and_cp2_equal_one_rank(tmp_path):
    """The frozen reference copy sharded like the policy: step 1 is ln 2 on each, and
    the loss and rewards of three steps agree within the project's parity tolerance;
    under cp2 each rank holds half of every 256-token row (the pairs' log-probs summed
    over the cp group)."""
    from titan_plugins.compare.tolerances import LOSS_PARITY

    seed_run = run([*TINY, "checkpoint.create_seed=true"], run_dir=tmp_path / "seed", timeout=300)
    assert seed_run.returncode == 0, seed_run.error  # one set of starting weights for both layouts
    seed = f"checkpoint.init_from={tmp_path / 'seed' / 'checkpoints' / 'seed'}"
    _, one = _go(tmp_path, "one", seed, "training.steps=3", "training.local_batch_size=4", "metrics.console=false")
    _, four = _go(tmp_path, "fsdp2_tp2", seed, "parallelism=fsdp2_tp2", "training.steps=3",
                  "training.local_batch_size=2", "metrics.console=false")
    _, cp = _go(tmp_path, "cp2", seed, "parallelism=cp2", "training.steps=3", "training.local_batch_size=4",
                "metrics.console=false")
    assert one[0]["loss"] == LN2
    for layout in (four, cp):
        assert len(layout) == len(one) == 3 and layout[0]["loss"] == pytest.approx(LN2, abs=1e-6)
        for step, (a, b) in enumerate(zip(one, layout), 1):
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


# ------------------------------------------------ objective.precompute_ref=true
def _toy_pairs(folder, n_train=6, n_held_out=4):
    """The first pairs of the sample and of its held-out split (the first pass reads them all)."""
    from titan_plugins.data.chat_source import ASSETS

    folder.mkdir(parents=True, exist_ok=True)
    out = []
    for name, n in (("preference_sample.jsonl", n_train), ("preference_sample_val.jsonl", n_held_out)):
        out.append(folder / name)
        out[-1].write_text("".join((ASSETS / name).read_text().splitlines(keepends=True)[:n]))
    return ["data=preference", f"data.path={out[0]}", "validation.enabled=true", "validation.every=4",
            "validation.steps=1", f"validation.path={out[1]}", "training.steps=4", "training.local_batch_size=4"]


@pytest.fixture(scope="module")
def precomputed(tmp_path_factory):
    """A one-rank run whose reference is precomputed: 6 pairs (3 steps an epoch, so step 4
    is the next epoch's order), held-out pairs at step 4."""
    tmp = tmp_path_factory.mktemp("precompute")
    common = _toy_pairs(tmp / "data")
    result, _ = _go(tmp, "pre", *common, "objective.precompute_ref=true")
    return tmp, common, result


def _all_records(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


KEYS = ("loss", *REWARDS, "logps/chosen", "logps/rejected", "grad_norm")


def test_precomputed_reference_equals_the_frozen_copy(precomputed):
    """No frozen copy: the first pass stores the starting weights' log-probs in the run
    directory and the run reads them: step 1 is ln 2, and every step and the held-out
    record equal the frozen copy's run bitwise (the same microbatches in the first epoch)."""
    from titan_plugins.objectives.precompute import STORE

    tmp, common, result = precomputed
    _go(tmp, "frozen", *common, "metrics.console=false")
    pre, frozen = _all_records(tmp / "pre"), _all_records(tmp / "frozen")
    assert [r.get("step", r.get("validation_step")) for r in pre] == [1, 2, 3, 4, 4]
    assert pre[0]["loss"] == LN2 and all(pre[0][k] == 0.0 for k in REWARDS)
    for a, b in zip(pre, frozen, strict=True):
        assert {k: a.get(k) for k in KEYS} == {k: b.get(k) for k in KEYS}, (a, b)
    assert pre[-1]["rewards/margins"] != 0.0  # validation read stored values too (the policy has moved)
    saved = torch.load(tmp / "pre" / STORE, weights_only=True)
    assert saved["keys"].numel() == 12 + 4  # 6 pairs' rows, and the 2 held-out pairs one batch scores
    assert ("reference: the starting weights' log-probs, precomputed in a first pass over 16 rows, "
            "no model copy") in result.stdout


@pytest.mark.slow
@pytest.mark.extended  # ~45 s: a seed, a one-rank run, two 2-rank launches; the suite checks the store against the frozen copy
def test_precomputed_values_serve_a_resume_on_another_layout(precomputed):
    """The store is keyed by each row's tokens, not by rank or position: from one seed
    checkpoint, fsdp2 on 2 ranks (1 pair per microbatch instead of 2) reads the one-rank
    run's store, resumes from its step-2 checkpoint reading it again, and trains like the
    one-rank run (parity tolerance)."""
    import shutil

    from titan_plugins.compare.tolerances import LOSS_PARITY
    from titan_plugins.objectives.precompute import STORE

    tmp, common, _ = precomputed
    seed_run = run([*TINY, "checkpoint.create_seed=true"], run_dir=tmp / "seed", timeout=300)
    assert seed_run.returncode == 0, seed_run.error  # one start for both layouts (a random one differs)
    common = [*common, f"checkpoint.init_from={tmp / 'seed' / 'checkpoints' / 'seed'}", "objective.precompute_ref=true"]
    _go(tmp, "one", *common)
    (tmp / "dp2").mkdir()
    shutil.copyfile(tmp / "one" / STORE, tmp / "dp2" / STORE)
    layout = [*common, "parallelism=fsdp2", "training.local_batch_size=2", "checkpoint.enabled=true",
              "checkpoint.interval=2"]
    first, _ = _go(tmp, "dp2", *layout, "training.steps=2")
    resumed, _ = _go(tmp, "dp2", *layout)
    for result in (first, resumed):
        assert "reference: the starting weights' log-probs, read from the first pass over 16 rows" in result.stdout
    one = [r for r in _all_records(tmp / "one") if "step" in r]
    two = [r for r in _all_records(tmp / "dp2") if "step" in r]
    assert [r["step"] for r in two] == [1, 2, 3, 4]
    assert two[0]["loss"] == pytest.approx(LN2, abs=1e-6)
    for step, (a, b) in enumerate(zip(one, two, strict=True), 1):
        assert LOSS_PARITY.allows(a["loss"], b["loss"], step), (step, a["loss"], b["loss"])
        assert b["rewards/margins"] == pytest.approx(a["rewards/margins"], rel=1e-4, abs=1e-5), step


@pytest.mark.parametrize("overrides, message", [
    (["objective.loss_type=simpo"], "objective.precompute_ref=true: dpo (loss_type simpo"),
    (["objective=sft", "data=chat_sample"], "objective.precompute_ref=true: sft uses no reference model"),
])
def test_precompute_ref_without_a_reference_is_one_line_before_launch(tmp_path, overrides, message):
    with pytest.raises(ConfigError) as err:
        run([*TINY, "objective.precompute_ref=true", *overrides], run_dir=tmp_path / "refused", timeout=60)
    assert message in str(err.value) and "\n" not in str(err.value)
    assert not (tmp_path / "refused" / "metrics.jsonl").exists()
