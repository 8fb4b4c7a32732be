"""In-process checks of the runtime pieces: no ranks are spawned here."""

from __future__ import annotations

import math

import pytest
import torch
from omegaconf import OmegaConf

from titan_plugins.distributed.clip_grad import clip_grad_norm_
from titan_plugins.distributed.pipeline import layer_ranges, stage_ids, validate_pipeline
from titan_plugins.errors import ConfigError
from titan_plugins.loss.token_loss import GlobalTokenLoss
from titan_plugins.model.optimizer import lr_lambda, param_groups
from titan_plugins.train.sweep import format_table

EXTRA = ["tiny_plugin"]


@pytest.fixture
def pm(monkeypatch):
    from titan_plugins.plugins import get_plugin_manager

    monkeypatch.setenv("TITAN_PLUGINS_EXTRA", "tiny_plugin")
    return get_plugin_manager(strict=True)


def test_layer_ranges_even_split_and_too_few_layers():
    assert layer_ranges(5, 2) == [(0, 3), (3, 5)]
    assert layer_ranges(4, 4) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert stage_ids(1, 2, 2) == [1, 3]
    with pytest.raises(ConfigError, match="3 layers, fewer than the 4 pipeline stages"):
        layer_ranges(3, 4)


def test_lr_schedule_warmup_then_decay():
    t = OmegaConf.create({"warmup_steps": 2, "steps": 10, "decay": "cosine", "min_lr_ratio": 0.1})
    assert lr_lambda(0, t) == pytest.approx(1 / 3)
    assert lr_lambda(2, t) == pytest.approx(1.0)
    assert lr_lambda(10, t) == pytest.approx(0.1)
    t.decay = "linear"
    assert lr_lambda(6, t) == pytest.approx(0.1 + 0.9 * 0.5)


def test_weight_decay_groups_skip_vectors():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    decay, no_decay = param_groups(model, 0.1)
    assert [p.ndim for p in decay["params"]] == [2] and no_decay["weight_decay"] == 0.0
    assert len(no_decay["params"]) == 3


def test_loss_is_sum_over_global_tokens():
    logits, labels = torch.randn(2, 3, 7), torch.randint(0, 7, (2, 3))
    loss_fn = GlobalTokenLoss()
    loss_fn.global_tokens = 12.0  # as if a second DP rank held 6 more tokens
    full = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
    assert loss_fn(logits, labels).item() == pytest.approx(full.item() / 2)


def test_clip_grad_norm_plain_tensors():
    a, b = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(4))
    a.grad, b.grad = torch.full((3,), 2.0), torch.full((4,), 2.0)
    norm = clip_grad_norm_([a, b], max_norm=1.0)
    assert norm.item() == pytest.approx(math.sqrt(7 * 4))
    assert torch.cat([a.grad, b.grad]).norm().item() == pytest.approx(1.0, rel=1e-5)


def test_pipeline_settings_are_checked():
    par = OmegaConf.create({"pp": 2, "pp_schedule": "1F1B", "pp_stages_per_rank": 2, "pp_microbatches": None})
    with pytest.raises(ConfigError, match="needs a multi-stage schedule"):
        validate_pipeline(par, 4)
    par.pp_schedule, par.pp_microbatches = "Interleaved1F1B", 3
    with pytest.raises(ConfigError, match="not divisible by parallelism.pp_microbatches=3"):
        validate_pipeline(par, 4)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["parallelism=tp2", "model.n_kv_heads=1"], "model.n_kv_heads=1 is not divisible by parallelism.tp=2"),
        (["parallelism=pp4", "model.n_layers=2"], "2 layers, fewer than the 4 pipeline stages"),
        (["parallelism.tp=2", "parallelism.etp=3"], "parallelism.etp=3 must be 1 or equal to parallelism.tp=2"),
        (["parallelism.dp_shard=3", "parallelism.world_size=4"], "multiply to 3"),
        (["parallelism=fsdp2_ep2"], "does not support parallelism.ep=2"),
        (["training.local_batch_size=0"], "training.local_batch_size=0 must be at least 1"),
        (["checkpoint.init_from=/nonexistent"], "checkpoint.init_from=/nonexistent"),
        (["model.vocab_size=1000"], "model.vocab_size=1000 is smaller than the shipped tokenizer (2048 ids)"),
        (["model.vocab_size=1000", "data=synthetic", "data.vocab_size=1024"],
         "model.vocab_size=1000 is smaller than data.vocab_size=1024"),
    ],
)
def test_bad_settings_fail_with_one_line_before_launch(pm, overrides, message):
    from titan_plugins.train.api import prepare_job

    with pytest.raises(ConfigError) as info:
        prepare_job(["model=tiny", *overrides], pm)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_a_vocabulary_that_holds_the_token_ids_is_accepted(pm):
    from titan_plugins.train.api import prepare_job

    prepare_job(["model=tiny", "model.vocab_size=1000", "data=synthetic", "data.vocab_size=1000"], pm)
    prepare_job(["model=tiny", "model.vocab_size=4096"], pm)  # larger than the tokenizer: fine


def test_cli_prints_one_error_line(monkeypatch, capsys):
    from titan_plugins.cli.run import main

    monkeypatch.setenv("TITAN_PLUGINS_EXTRA", "tiny_plugin")
    assert main(["model=tiny", "parallelism=tp4"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: model.n_kv_heads=2 is not divisible by parallelism.tp=4"]


def test_sweep_table_drops_common_overrides():
    rows = [
        {"job": "0", "overrides": "model=tiny parallelism=single", "final_loss": 7.5, "tokens_per_s": 10.0,
         "status": "ok"},
        {"job": "1", "overrides": "model=tiny parallelism=fsdp2", "status": "failed", "error": "boom\ntb"},
    ]
    table = format_table(rows)
    assert "parallelism=fsdp2" in table and "model=tiny" not in table
    assert "7.5000" in table and "failed: boom" in table


def test_a_failing_rank_records_its_error_before_tearing_down_the_process_group(tmp_path, monkeypatch, pm):
    # Teardown wakes the peers with errors of their own, and once one exits the agent
    # may kill this rank: what it failed with must already be on disk by then.
    import json

    import torch.distributed as dist

    from titan_plugins.train import trainer, worker
    from titan_plugins.train.api import prepare_job, write_config

    spec, job, _ = prepare_job(["model=tiny", "parallelism=fsdp2"], pm, run_dir=tmp_path / "run")
    config = write_config(job, tmp_path / "run")
    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    monkeypatch.setenv("RANK", "1")

    class FailingTrainer:
        def __init__(self, *args, **kwargs):
            raise RuntimeError("tiny: injected failure on rank 1")

    on_disk_at_teardown = []
    monkeypatch.setattr(trainer, "Trainer", FailingTrainer)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "destroy_process_group",
                        lambda: on_disk_at_teardown.append(json.loads(error_file.read_text())))
    with pytest.raises(SystemExit) as info:
        worker.entry(str(config))
    assert info.value.code == 1
    assert len(on_disk_at_teardown) == 1
    recorded = on_disk_at_teardown[0]["message"]["message"]
    assert recorded.startswith("rank 1 crashed: RuntimeError: tiny: injected failure on rank 1")
    assert json.loads(error_file.read_text()) == on_disk_at_teardown[0]  # recorded once, not rewritten


def test_launcher_names_the_rank_that_recorded_first_even_if_torch_lists_only_a_peer(tmp_path, monkeypatch):
    # Rank 1 records its crash; its teardown wakes rank 0, which records and exits
    # first, so torch's ChildFailedError lists rank 0 only (rank 1 is then stopped).
    import time

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from titan_plugins.distributed.launcher import (
        FAILURE_DIR_ENV,
        _first_failure,
        read_failure_records,
    )
    from titan_plugins.train import worker

    monkeypatch.setenv(FAILURE_DIR_ENV, str(tmp_path / "records"))
    (tmp_path / "records").mkdir()
    for rank, exc in ((1, RuntimeError("tiny: injected failure on rank 1")),
                      (0, RuntimeError("[gloo/transport/tcp/pair.cc] Connection closed by peer"))):
        monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / f"error-{rank}.json"))
        monkeypatch.setenv("RANK", str(rank))
        worker.record_failure(exc)
        time.sleep(0.01)
    only_rank0 = {0: ProcessFailure(local_rank=0, pid=100, exitcode=1, error_file=str(tmp_path / "error-0.json"))}
    exc = ChildFailedError("entry", only_rank0)
    assert _first_failure(exc)[0] == 0  # torch's view alone names the wrong rank
    rank, text, user, code = _first_failure(exc, read_failure_records(tmp_path / "records"))
    assert (rank, user, code) == (1, False, 1)
    assert text.startswith("rank 1 crashed: RuntimeError: tiny: injected failure on rank 1")
