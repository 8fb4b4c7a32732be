"""The GPU path, tested on CPU where it can be: float8 refusals before launch, the
peak in the run's compute dtype, the CPU probe and its cache, the CUDA branches of
device/backend selection (monkeypatched), and scripts/gpu_check.sh's CPU path.
Tests marked ``gpu`` need a CUDA device and skip without one."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

from titan_plugins.config.schema import JobConfig
from titan_plugins.errors import ConfigError
from titan_plugins.train import peak

ROOT = Path(__file__).resolve().parents[1]
CUDA = torch.cuda.is_available()


@pytest.fixture
def pm(monkeypatch):
    from titan_plugins.plugins import get_plugin_manager

    monkeypatch.setenv("TITAN_PLUGINS_EXTRA", "tiny_plugin")
    return get_plugin_manager(strict=True)


def _gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module
    spec.loader.exec_module(module)
    return module


def _fake_cuda(monkeypatch, name="NVIDIA H100 80GB HBM3", capability=(9, 0)):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: name)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: capability)


# ------------------------------------------------------------------ float8
@pytest.mark.skipif(CUDA, reason="the refusal is for machines without CUDA")
def test_float8_refused_before_launch_without_cuda(pm):
    from titan_plugins.train.api import prepare_job

    for preset, recipe in (("float8_rowwise", "rowwise"), ("float8_tensorwise", "tensorwise")):
        with pytest.raises(ConfigError) as err:
            prepare_job(["model=tiny", f"precision={preset}"], pm)
        message = str(err.value)
        assert "\n" not in message
        assert message.startswith(f"precision.float8={recipe} needs a CUDA GPU with compute capability 8.9+")
    # plan mode plans float8 jobs on any machine
    prepare_job(["model=tiny", "precision=float8_rowwise", "plan.enabled=true"], pm)


def test_float8_refusals_per_cause(monkeypatch):
    from titan_plugins.distributed.float8 import check_float8

    def job(**precision):
        cfg = OmegaConf.structured(JobConfig)
        cfg.model = {}
        for key, value in precision.items():
            OmegaConf.update(cfg, key, value)
        return cfg

    check_float8(job())  # no float8: nothing to check
    with pytest.raises(ConfigError, match=r"float8=rowwise with precision.compute_dtype=bfloat16"):
        check_float8(job(**{"precision.float8": "rowwise", "precision.compute_dtype": "bfloat16"}))
    with pytest.raises(ConfigError, match=r"float8=tensorwise with parallelism.tp=2"):
        check_float8(job(**{"precision.float8": "tensorwise", "parallelism.tp": 2}))
    with pytest.raises(ConfigError, match=r"this job runs on cpu"):
        check_float8(job(**{"precision.float8": "rowwise", "parallelism.device": "cpu"}))
    _fake_cuda(monkeypatch, "NVIDIA A100-SXM4-80GB", (8, 0))
    with pytest.raises(ConfigError, match=r"needs compute capability 8.9\+; NVIDIA A100-SXM4-80GB has 8.0$"):
        check_float8(job(**{"precision.float8": "rowwise"}))
    _fake_cuda(monkeypatch, "NVIDIA H100 80GB HBM3", (9, 0))
    monkeypatch.setitem(sys.modules, "torchao", None)  # import torchao.float8 -> ImportError
    with pytest.raises(ConfigError, match=r"^precision.float8=rowwise needs torchao: pip install 'titan-plugins\[float8\]'$"):
        check_float8(job(**{"precision.float8": "rowwise"}))


def test_float8_conversion_emulated_on_cpu():
    """torchao's emulated float8 (no float8 GEMM) through the real conversion: only
    where torchao is installed; it is not a CI dependency."""
    pytest.importorskip("torchao.float8")
    from torch import nn

    from titan_plugins.distributed.float8 import convert_float8

    model = nn.ModuleDict({"w1": nn.Linear(32, 64, bias=False), "odd": nn.Linear(32, 8, bias=False),
                           "router": nn.ModuleDict({"gate": nn.Linear(32, 16, bias=False)}),
                           "output": nn.Linear(64, 32, bias=False)})
    job = OmegaConf.structured(JobConfig)
    job.precision.float8 = "tensorwise"
    convert_float8(model, job, SimpleNamespace(dp_shard=1), emulate=True)
    kinds = {name: type(m).__name__ for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    assert kinds == {"w1": "Float8Linear", "odd": "Linear", "router.gate": "Linear", "output": "Linear"}
    x = torch.randn(4, 32, requires_grad=True)
    model["output"](model["w1"](x)).sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()


# ------------------------------------------------------------------ peaks
@pytest.mark.parametrize(("preset", "dtype"), [("fp32", "fp32"), ("bf16_mixed", "bf16"), ("bf16_compute", "bf16"),
                                               ("float8_rowwise", "fp8"), ("float8_tensorwise", "fp8")])
def test_precision_preset_dtype(preset, dtype):
    precision = OmegaConf.load(ROOT / "titan_plugins" / "conf" / "precision" / f"{preset}.yaml")
    assert peak.precision_dtype(precision) == dtype


def test_run_peak_uses_the_compute_dtype(monkeypatch):
    job = OmegaConf.structured(JobConfig)
    job.precision.param_dtype = "bfloat16"
    _fake_cuda(monkeypatch, "NVIDIA H100 PCIe")
    assert peak.run_peak_tflops(job, "cuda") == 756.0
    job.precision.float8 = "rowwise"
    assert peak.run_peak_tflops(job, "cuda") == 1513.0
    job.metrics.peak_tflops = 123.0  # the override wins everywhere
    assert peak.run_peak_tflops(job, "cuda") == 123.0
    assert peak.run_peak_tflops(job, "cpu") == 123.0
    job.metrics.peak_tflops = None
    monkeypatch.setenv(peak.CPU_PEAK_ENV, "fp32=0.2,bf16=0.9")
    assert peak.run_peak_tflops(job, "cpu") is None  # fp8: no CPU peak
    job.precision.float8 = None
    assert peak.run_peak_tflops(job, "cpu") == 0.9


def test_cpu_probe_keeps_the_best_per_threads(monkeypatch, tmp_path):
    monkeypatch.delenv(peak.CPU_PEAK_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    calls = []
    measured = {torch.bfloat16: 0.5, torch.float32: 0.125, torch.float16: 0.125}

    def fake_measure(dtype, seconds=0.3, n=2048):
        calls.append((dtype, torch.get_num_threads()))
        return measured[dtype]

    monkeypatch.setattr(peak, "measure_matmul_tflops", fake_measure)
    monkeypatch.setattr(os, "getloadavg", lambda: (0.0, 0.0, 0.0))  # a quiet machine: probes are cached
    threads = torch.get_num_threads()
    assert peak.cpu_peak_tflops("bf16") == 0.5
    assert peak.cpu_peak_tflops("fp32", probe=False) is None  # not measured yet, not probed
    assert peak.cpu_peak_tflops("fp32") == 0.125
    assert calls == [(torch.bfloat16, threads), (torch.float32, threads)]
    cache = json.loads((tmp_path / "titan-plugins" / "cpu_peak.json").read_text())
    (key, entry), = cache.items()
    assert f"threads {threads}" in key and torch.__version__ in key and entry == {"bf16": 0.5, "fp32": 0.125}
    measured[torch.bfloat16] = 0.05  # a probe that reads low (the cores were shared) ...
    assert peak.cpu_peak_tflops("bf16") == 0.5  # ... never lowers the cached peak
    assert peak.cpu_peak_tflops("bf16", probe=False) == 0.5
    measured[torch.float32] = 0.25  # a better probe raises it
    assert peak.cpu_peak_tflops("fp32") == 0.25 and peak.cpu_peak_tflops("fp32", probe=False) == 0.25
    try:  # another thread count is another machine for the probe
        torch.set_num_threads(threads + 1)
        assert peak.cpu_peak_tflops("bf16") == 0.05
    finally:
        torch.set_num_threads(threads)
    assert calls[-1] == (torch.bfloat16, threads + 1)
    monkeypatch.setattr(os, "getloadavg", lambda: (1000.0, 0.0, 0.0))  # loaded: used, not cached
    assert peak.cpu_peak_tflops("fp16") == 0.125
    assert peak.cpu_peak_tflops("fp16", probe=False) is None
    n_calls = len(calls)
    monkeypatch.setenv(peak.CPU_PEAK_ENV, "off")
    assert peak.cpu_peak_tflops("bf16") is None
    monkeypatch.setenv(peak.CPU_PEAK_ENV, "0.7")
    assert peak.cpu_peak_tflops("fp32") == 0.7
    monkeypatch.setenv(peak.CPU_PEAK_ENV, "fast")
    with pytest.raises(ValueError, match="TITAN_CPU_PEAK_TFLOPS"):
        peak.cpu_peak_tflops("fp32")
    assert len(calls) == n_calls  # presets never probe


def test_matmul_probe_measures_something():
    """... without drawing from torch's generator: only rank 0 probes, and a draw there
    left rank 0's training-time sampling out of step with its TP peers' (PhiMoE's experts)."""
    state = torch.get_rng_state()
    assert 0 < peak.measure_matmul_tflops(torch.float32, seconds=0.01, n=512) < 1000
    assert torch.equal(torch.get_rng_state(), state)


# ------------------------------------------------------ device and backend
def test_cuda_device_and_backend_selection(monkeypatch):
    from titan_plugins.distributed.parallel_dims import ParallelDims, default_device_and_backend
    from titan_plugins.train import trainer

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert default_device_and_backend() == ("cpu", "gloo")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert default_device_and_backend() == ("cuda", "nccl")
    assert default_device_and_backend("cpu") == ("cpu", "gloo")
    assert default_device_and_backend("auto", "gloo") == ("cuda", "gloo")

    calls: dict = {}
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: calls.setdefault("set_device", index))
    monkeypatch.setattr(trainer.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(trainer.dist, "init_process_group", lambda **kw: calls.setdefault("init", kw))
    monkeypatch.setattr(ParallelDims, "build_meshes", lambda self, device_type: calls.setdefault("mesh", device_type))
    for key, value in {"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1", "MASTER_ADDR": "localhost",
                       "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(key, value)
    job = OmegaConf.structured(JobConfig)
    job.parallelism.dp_shard = 2
    dims, device = trainer.init_distributed(job)
    assert device == torch.device("cuda", 1) and calls["set_device"] == 1 and calls["mesh"] == "cuda"
    assert calls["init"] == {"backend": "cpu:gloo,cuda:nccl", "world_size": 2, "rank": 1}
    assert dims.dp_shard == 2


# ------------------------------------------------------------ gpu_check
def test_gpu_check_rows_and_metrics(tmp_path):
    gc = _gpu_check()
    rows = gc.build_rows(1)
    assert len(rows) == 16 and {r.model for r in rows} == {"deepseek_v3", "qwen3", "llama4", "llama3"}
    assert {(r.shape == "debugmodel", r.compile) for r in rows} == {(True, False), (True, True), (False, False),
                                                                    (False, True)}
    assert all(r.world == 1 and r.precision == "bf16_compute" for r in rows)
    multi = [r for r in gc.build_rows(4) if r.world > 1]
    assert {r.parallelism for r in multi} >= {"fsdp2", "tp2", "fsdp2_ep2", "fsdp2_tp2_ep2"}
    assert {r.precision for r in multi if "fsdp" in r.parallelism} == {"bf16_mixed"}
    args = rows[3].args(5)
    assert "training.compile=true" in args and "training.steps=5" in args and args[0] == "model=deepseek_v3"

    path = tmp_path / "metrics.jsonl"
    recs = [{"step": i, "loss": 5.0 - i, "tokens_per_s": 100.0 * i, "tflops": 1.0 * i, "memory_gib": 2.0 + i}
            for i in range(1, 7)]
    path.write_text("\n".join(json.dumps(r) for r in [{"start": 1}, *recs, {"validation_step": 3, "loss": 9}]))
    got = gc.summarize_metrics(path, warmup=2)
    assert got == {"steps": 6, "tokens_per_s": 450.0, "tflops": 4.5, "memory_gib": 8.0, "loss": -1.0}
    line = gc.format_row(rows[0], got, 10.0, 989.0)
    assert "MFU   0.5%" in line and "measured/plan 0.80" in line
    assert "FAILED: boom" in gc.format_row(rows[0], None, None, None, "boom")


@pytest.mark.skipif(CUDA, reason="the CPU path of the script")
def test_gpu_check_script_skips_without_cuda(capsys):
    env = {**os.environ, "PYTHON": sys.executable}
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh")], capture_output=True, text=True,
                          env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpu_check: no CUDA device") and "skipped" in lines[0]
    # a driver but no CUDA torch: the helper's own check
    assert _gpu_check().main([]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpu_check: no CUDA device") and "skipped" in lines[0]


# ------------------------------------------------------------------ GPU
@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_cuda_run_reports_mfu_and_memory(tmp_path):
    from titan_plugins.train.api import run

    result = run(["model=tiny", "training.steps=3", "precision=bf16_compute"], run_dir=tmp_path,
                 extra_plugins=["tiny_plugin"], timeout=300)
    assert result.ok, result.error
    last = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()][-1]
    assert last["memory_gib"] > 0
    if peak.peak_tflops_for_name(torch.cuda.get_device_name(), "bf16"):
        assert last["mfu"] > 0
