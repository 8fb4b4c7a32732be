"""A run a person can follow: the run header/summary and ETA (train/run_report.py), the
MLflow and W&B sinks (train/sinks/), profiler traces (train/profiling.py).

One real 3-step run covers the sinks, the header/summary lines and the trace; the rest
is in-process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn

from titan_plugins.errors import ConfigError
from titan_plugins.testing.wandb_log import wandb_records
from titan_plugins.train.run_report import (
    RunStats,
    count_parameters,
    eta_seconds,
    format_count,
    format_duration,
    header_lines,
    summary_lines,
)

BASE = ["model=tiny", "training.seq_len=32", "training.local_batch_size=2", "metrics.tensorboard=false",
        "training.steps=3"]
EXTRA = ["tiny_plugin"]


# ------------------------------------------------------------------ pure formatting
def test_format_duration_and_count() -> None:
    assert [format_duration(s) for s in (4.24, 42, 65.4, 3725)] == ["4.2s", "42s", "1m05s", "1h02m05s"]
    assert format_duration(float("inf")) == "?"
    assert [format_count(n) for n in (999, 168_220, 6.7e9)] == ["999", "168.22K", "6.70B"]


def test_eta_leaves_out_the_first_step() -> None:
    # step 1 ended at t=10 (start-up, compile), then 2 s per step: 2 steps left = 4 s
    assert eta_seconds(3, 5, first_step=1, first_time=10.0, now=14.0, last_step_time=2.0) == 4.0
    assert eta_seconds(1, 5, first_step=1, first_time=10.0, now=10.0, last_step_time=9.0) == 36.0
    assert eta_seconds(5, 5, first_step=1, first_time=10.0, now=18.0, last_step_time=2.0) == 0.0


def test_header_and_summary_lines() -> None:
    header = "\n".join(header_lines(
        model="qwen3", flavor="debugmodel", params_total=6_000_000, params_active=2_000_000,
        world="8 ranks", meshes="dp_shard=4 x tp=2", device="cuda", precision="bf16_mixed",
        global_batch_seqs=16, seq_len=128, steps=100, start_step=40, run_dir="/runs/a",
        tensorboard="/runs/a/tensorboard", metrics_jsonl="/runs/a/metrics.jsonl"))
    for text in ("qwen3 (flavor debugmodel), 6.00M total, 2.00M active per token parameters",
                 "8 ranks on cuda", "dp_shard=4 x tp=2", "16 sequences x 128 tokens = 2,048 tokens",
                 "resuming after step 40", "tensorboard --logdir /runs/a/tensorboard", "/runs/a/metrics.jsonl"):
        assert text in header
    stats = RunStats(start_time=0.0, start_step=0)
    for step, loss in enumerate([3.0, 2.0, 2.5], start=1):
        stats.update(step, {"loss": loss, "tokens_per_s": 100.0, "step_time_s": 0.5, "memory_gib": step},
                     now=float(step), total_steps=3)
    summary = "\n".join(summary_lines(stats, 10.0, memory_kind="max RSS", checkpoint=None))
    for text in ("step 3 (3 steps in this run), wall time 10s", "final 2.5000, best 2.0000 at step 2",
                 "100 tokens/s, all ranks (150 tokens in 1.5s of steps)", "peak 3.00 GiB", "none saved"):
        assert text in summary


class _MoE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.experts = nn.Linear(4, 8 * 10, bias=False)  # 320 parameters, 8 experts
        self.experts.num_experts = 8
        self.router = nn.Linear(4, 8, bias=False)  # 32
        self.router.top_k = 2


def test_count_parameters_counts_top_k_of_the_routed_experts() -> None:
    model = nn.Sequential(nn.Linear(10, 4, bias=False), _MoE())
    with torch.device("meta"):
        meta = nn.Sequential(nn.Linear(10, 4, bias=False), _MoE())
    assert count_parameters(model) == count_parameters(meta) == (40 + 320 + 32, 40 + 80 + 32)


# ------------------------------------------------------------------ pre-launch checks
def test_a_sink_without_its_package_fails_before_launch(tmp_path, monkeypatch) -> None:
    import importlib.util

    from titan_plugins.train.api import run

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ConfigError, match=r"metrics.wandb.enabled=true needs the wandb package "
                                          r"\(pip install 'titan-plugins\[wandb\]'\)"):
        run([*BASE, "metrics.wandb.enabled=true"], run_dir=tmp_path / "r", extra_plugins=EXTRA, timeout=60)
    assert not (tmp_path / "r" / "metrics.jsonl").exists()


def test_bad_profiling_steps_fail_before_launch() -> None:
    from titan_plugins.train.profiling import check_profiling

    job = OmegaConf.create({"profiling": {"enabled": True, "start_step": 0, "steps": 2, "memory_snapshot": False}})
    with pytest.raises(ConfigError, match="profiling.start_step=0 must be at least 1"):
        check_profiling(job)


def test_memory_snapshot_is_dumped_after_the_traced_steps_and_on_oom(tmp_path, monkeypatch) -> None:
    """The CUDA branch with torch's allocator calls replaced (no GPU here)."""
    from titan_plugins.train.profiling import StepProfiler

    calls: list = []
    observers: list = []
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history",
                        lambda enabled=None, max_entries=0: calls.append(("record", enabled)))
    monkeypatch.setattr(torch.cuda.memory, "_dump_snapshot", lambda path: calls.append(("dump", Path(path).name)))
    monkeypatch.setattr(torch._C, "_cuda_attach_out_of_memory_observer", observers.append, raising=False)
    job = OmegaConf.create({"profiling": {"enabled": False, "start_step": 2, "steps": 2, "memory_snapshot": True}})
    prof = StepProfiler(job, str(tmp_path), rank=1, device_type="cuda", resumed_at=0)
    assert calls == [("record", "all")]  # from the start of training
    for step in (1, 2):
        prof.step(step)
    assert len(calls) == 1
    prof.step(3)  # the last of steps 2..3
    prof.close(4)
    assert calls[1:] == [("dump", "memory_snapshot_rank1_step3.pickle")]
    observers[0](0, 2**30, 0, 0)  # an out-of-memory error
    assert calls[-1] == ("dump", "memory_snapshot_rank1_oom.pickle")


# ------------------------------------------------------------------ one real run
@pytest.fixture(scope="module")
def reported_run(tmp_path_factory):
    pytest.importorskip("mlflow")
    pytest.importorskip("wandb")
    from titan_plugins.train.api import run

    run_dir = tmp_path_factory.mktemp("report") / "run"
    overrides = [*BASE, "metrics.mlflow.enabled=true", "metrics.mlflow.experiment=tests",
                 "metrics.wandb.enabled=true", "metrics.wandb.mode=offline", "metrics.wandb.project=tests",
                 "profiling.enabled=true", "profiling.start_step=2", "profiling.steps=1"]
    result = run(overrides, run_dir=run_dir, extra_plugins=EXTRA, timeout=240,
                 env={"WANDB_MODE": "offline", "WANDB_SILENT": "true"})
    assert result.returncode == 0, f"{result.error}\n{result.stderr[-3000:]}"
    assert len(result.losses) == 3
    return result


@pytest.mark.slow  # a real run in a subprocess
def test_header_summary_and_eta_on_a_real_run(reported_run) -> None:
    out, run_dir = reported_run.stdout, reported_run.run_dir
    assert "model       tiny (flavor debugmodel)" in out and "parameters" in out
    assert "world       1 rank on cpu" in out
    assert "batch       2 sequences x 32 tokens = 64 tokens per step" in out
    assert f"metrics     {run_dir / 'metrics.jsonl'}" in out
    step_lines = [line for line in out.splitlines() if line.startswith("step ")]
    assert len(step_lines) == 3 and all("| ETA " in line for line in step_lines)
    assert "finished    step 3 (3 steps in this run)" in out
    best = min(reported_run.losses)
    assert f"final {reported_run.losses[-1]:.4f}, best {best:.4f}" in out
    assert out.index("model       tiny") < out.index(step_lines[0]) < out.index("finished    step 3")


@pytest.mark.slow  # a real run in a subprocess
def test_hook_titan_on_step_end_mlflow_sink(reported_run) -> None:
    import os

    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=(reported_run.run_dir / "mlruns").as_uri())
    experiment = client.get_experiment_by_name("tests")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.status == "FINISHED"
    assert run.info.run_name == f"tiny-debugmodel-{reported_run.run_dir.name}"
    assert run.data.params["training.steps"] == "3" and run.data.params["model.name"] == "tiny"
    history = client.get_metric_history(run.info.run_id, "train/loss")
    assert [(m.step, m.value) for m in history] == list(zip([1, 2, 3], reported_run.losses))
    assert {"train/grad_norm", "train/lr", "train/tokens_per_s"} <= set(run.data.metrics)


@pytest.mark.slow  # a real run in a subprocess
def test_hook_titan_on_step_end_wandb_offline_sink(reported_run) -> None:
    (run_file,) = (reported_run.run_dir / "wandb").glob("offline-run-*/run-*.wandb")
    records = wandb_records(run_file)
    (run_rec,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert run_rec.project == "tests"
    config = {item.key: json.loads(item.value_json) for item in run_rec.config.update}
    assert config["training.steps"] == 3
    rows = [{i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
            for r in records if r.WhichOneof("record_type") == "history"]
    assert [(row["_step"], row["train/loss"]) for row in rows] == list(zip([1, 2, 3], reported_run.losses))


@pytest.mark.slow  # a real run in a subprocess
def test_profiled_run_leaves_a_trace_per_rank(reported_run) -> None:
    (trace,) = (reported_run.run_dir / "profile").glob("rank0.*.pt.trace.json")
    events = json.loads(trace.read_text())["traceEvents"]
    steps = {e["name"] for e in events if e.get("name", "").startswith("ProfilerStep#")}
    assert steps == {"ProfilerStep#2"}  # profiling.start_step=2, profiling.steps=1


@pytest.mark.parametrize("name, flavor", [("deepseek_v3", "debugmodel"), ("qwen3", "debugmodel_moe"),
                                          ("llama4", "debugmodel")])
def test_header_counts_equal_the_plugins_own(name, flavor) -> None:
    """The header's generic count on the meta model equals each first-party plugin's
    own ``(total, active)`` (measured equal on every flavor, 671B included)."""
    import importlib

    from titan_plugins.plugins import get_plugin_manager

    own = {"deepseek_v3": ("titan_deepseek_v3.config", "param_counts"), "qwen3": ("titan_qwen3.config", "num_params"),
           "llama4": ("titan_llama4.config", "num_params")}[name]
    pm = get_plugin_manager()
    if name not in pm.models():
        pytest.skip(f"{name} is not installed")
    spec = pm.get_model(name)
    config = spec.flavor(flavor)
    with torch.device("meta"):
        model = spec.load("build")(config)
    counts = getattr(importlib.import_module(own[0]), own[1])(config)
    expected = (counts.total, counts.active) if hasattr(counts, "active") else tuple(counts)
    assert count_parameters(model) == expected and expected[1] < expected[0]
