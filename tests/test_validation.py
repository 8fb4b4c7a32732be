"""Validation during training (titan_plugins/train/validation.py): the held-out loss
equals a hand computation, training is bitwise the same with it, and FSDP x TP and PP
score the same rows to within LOSS_PARITY."""

from __future__ import annotations

import json
import math

import pytest
from omegaconf import OmegaConf

from titan_plugins.compare.tolerances import LOSS_PARITY
from titan_plugins.errors import ConfigError
from titan_plugins.train.api import run
from titan_plugins.train.metrics import ConsoleSink, JsonlSink

BASE = ["model=tiny", "training.seq_len=32", "metrics.tensorboard=false", "metrics.console=false",
        "training.steps=3"]
VALIDATION = ["validation.enabled=true", "validation.every=2", "validation.steps=2"]
EXTRA = ["tiny_plugin"]
TIMEOUT = 240


def _run(tmp, name, *overrides):
    result = run([*BASE, *overrides], run_dir=tmp / name, extra_plugins=EXTRA, timeout=TIMEOUT)
    assert result.returncode == 0, f"{name}: {result.error}\n{result.stderr[-3000:]}"
    return result


def _validations(run_dir) -> dict[int, dict]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["validation_step"]: r for r in records if "validation_step" in r}


def test_hook_titan_on_validation_end(tmp_path, capsys) -> None:
    job = OmegaConf.create({"metrics": {"jsonl": True, "console": True}})
    jsonl, console = JsonlSink(), ConsoleSink()
    jsonl.titan_on_train_start(job_config=job, run_dir=str(tmp_path), rank=0)
    for rank in (0, 1):  # sinks write on rank 0 only
        metrics = {"loss": 2.0, "perplexity": math.exp(2.0), "tokens": 64.0}
        jsonl.titan_on_validation_end(step=4, metrics=metrics, job_config=job, rank=rank)
        console.titan_on_validation_end(step=4, metrics=metrics, job_config=job, rank=rank)
    jsonl.titan_on_train_end(step=4, metrics={}, job_config=job, rank=0)
    assert _validations(tmp_path) == {4: {"validation_step": 4, "loss": 2.0, "perplexity": math.exp(2.0),
                                         "tokens": 64.0}}
    assert capsys.readouterr().out.count("validation at step") == 1


def test_builtin_validation_split_is_held_out() -> None:
    import numpy as np

    from titan_plugins.data.sources import builtin_split

    tokens = np.arange(1000)
    train, val = builtin_split(tokens, "train"), builtin_split(tokens, "validation")
    assert len(val) == 50 and np.array_equal(np.concatenate([train, val]), tokens)
    with pytest.raises(ConfigError, match="data.split='test'"):
        builtin_split(tokens, "test")


@pytest.mark.parametrize("overrides, message", [
    (["validation.every=0"], "validation.every=0 must be at least 1"),
    (["data.name=jsonl", "data.path={tmp}/x.jsonl"], "validation.path is needed with data.name=jsonl"),
])
def test_bad_validation_settings_fail_before_launch(tmp_path, overrides, message) -> None:
    (tmp_path / "x.jsonl").write_text('{"text": "a readable training file"}\n')  # checked first
    overrides = [o.format(tmp=tmp_path) for o in overrides]
    with pytest.raises(ConfigError, match=message):
        run([*BASE, *VALIDATION, *overrides], run_dir=tmp_path / "r", extra_plugins=EXTRA, timeout=60)
    assert not (tmp_path / "r" / "metrics.jsonl").exists()


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """One rank from a seed checkpoint: without validation, and with it (final params dumped)."""
    tmp = tmp_path_factory.mktemp("validation")
    _run(tmp, "seed", "checkpoint.create_seed=true")
    seed = tmp / "seed" / "checkpoints" / "seed"
    common = [f"checkpoint.init_from={seed}", "training.local_batch_size=4"]
    plain = _run(tmp, "plain", *common)
    with_val = _run(tmp, "with_val", *common, *VALIDATION, "training.dump_final_params=true")
    return tmp, seed, plain, with_val


@pytest.mark.slow
def test_training_is_bitwise_the_same_with_validation(single) -> None:
    _, _, plain, with_val = single
    assert with_val.losses == plain.losses  # exact floats: validation changed nothing
    assert with_val.grad_norms == plain.grad_norms
    assert sorted(_validations(with_val.run_dir)) == [2, 3]  # every 2 steps and after the last


@pytest.mark.slow
def test_validation_loss_equals_a_hand_computation(single) -> None:
    import torch
    import torch.nn.functional as F

    from titan_plugins.data import build_dataloader, build_tokenizer
    from titan_plugins.plugins import get_plugin_manager

    _, _, _, with_val = single
    reported = _validations(with_val.run_dir)[3]
    pm = get_plugin_manager(autoload=False)
    pm.load_modules(EXTRA)
    spec = pm.get_model("tiny")
    config = spec.flavor("debugmodel")
    torch.manual_seed(0)
    model = spec.load("build")(config)
    model.init_weights()
    missing, unexpected = model.load_state_dict(torch.load(with_val.run_dir / "final_params.pt"), strict=False)
    assert not unexpected and all("freqs" in k or "rope" in k for k in missing)
    data = OmegaConf.create({"name": "builtin", "split": "validation", "tokenizer": None, "path": None,
                             "text_field": "text", "vocab_size": None, "num_workers": 0, "prefetch_factor": 2,
                             "mix": []})
    rows = iter(build_dataloader(data, build_tokenizer(data), dp_rank=0, dp_world=1, local_batch_size=4,
                                 seq_len=32, seed=0, datasets=pm.datasets()))
    total, tokens = 0.0, 0
    with torch.no_grad():
        for _ in range(2):
            inputs, labels = next(rows)
            logits = model(inputs).float()
            total += float(F.cross_entropy(logits.flatten(0, 1), labels.flatten(0, 1), reduction="sum"))
            tokens += labels.numel()
    assert reported["tokens"] == tokens
    assert reported["loss"] == pytest.approx(total / tokens, rel=1e-5)
    assert reported["perplexity"] == pytest.approx(math.exp(total / tokens), rel=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("parallel", [
    ["parallelism=fsdp2_tp2", "training.local_batch_size=2"],
    ["parallelism=pp2", "training.local_batch_size=4"],
], ids=["fsdp2_tp2", "pp2"])
def test_validation_loss_is_the_same_under_parallelism(single, parallel) -> None:
    tmp, seed, _, with_val = single
    name = parallel[0].split("=")[1]
    other = _run(tmp, name, f"checkpoint.init_from={seed}", *VALIDATION, *parallel)
    ref, got = _validations(with_val.run_dir), _validations(other.run_dir)
    assert sorted(got) == sorted(ref)
    for step in ref:
        assert got[step]["tokens"] == ref[step]["tokens"]
        assert LOSS_PARITY.allows(ref[step]["loss"], got[step]["loss"]), (step, ref[step], got[step])
    assert ref[2]["loss"] != ref[3]["loss"]  # the model moved between validations: equality is not vacuous
