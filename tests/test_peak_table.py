"""Device peak table: per-variant, per-dtype lookup from the CUDA device name."""

import pytest
import torch

from titan_plugins.train import metrics, peak


@pytest.mark.parametrize(
    ("name", "bf16", "fp32", "fp8"),
    [
        ("NVIDIA H100 80GB HBM3", 989.0, 67.0, 1979.0),
        ("NVIDIA H100 PCIe", 756.0, 51.0, 1513.0),
        ("NVIDIA H100 NVL", 835.0, 60.0, 1671.0),
        ("NVIDIA H200", 989.0, 67.0, 1979.0),
        ("NVIDIA H200 NVL", 835.0, 60.0, 1671.0),
        ("NVIDIA GH200 480GB", 989.0, 67.0, 1979.0),
        ("NVIDIA B200", 2250.0, 75.0, 4500.0),
        ("NVIDIA GB200", 2500.0, 80.0, 5000.0),
        ("NVIDIA A100-SXM4-80GB", 312.0, 19.5, None),
        ("NVIDIA L40S", 362.0, 91.6, 733.0),
        ("NVIDIA L40", 181.0, 90.5, 362.0),
        ("NVIDIA L4", 121.0, 30.3, 242.0),
        ("NVIDIA A10", 125.0, 31.2, None),
        ("AMD Instinct MI300X", 1307.0, 163.4, 2615.0),
        ("AMD Instinct MI325X", 1307.0, 163.4, 2615.0),
        ("AMD Instinct MI355X", 2500.0, 157.3, 5000.0),
        ("Some Unknown GPU", None, None, None),
    ],
)
def test_peak_by_name_and_dtype(name, bf16, fp32, fp8):
    assert peak.peak_tflops_for_name(name) == bf16  # bf16 is the default dtype
    assert peak.peak_tflops_for_name(name, "bf16") == bf16
    assert peak.peak_tflops_for_name(name, torch.float32) == fp32
    assert peak.peak_tflops_for_name(name, "float8") == fp8
    assert peak.peak_tflops_for_name(name, "float16") == bf16  # fp16 tensor cores run at the bf16 rate


def test_fp16_only_device_and_bad_dtype():
    assert peak.peak_tflops_for_name("Tesla V100-SXM2-16GB", "fp16") == 125.0
    assert peak.peak_tflops_for_name("Tesla V100-SXM2-16GB", "bf16") is None
    with pytest.raises(ValueError, match="int8"):
        peak.peak_tflops_for_name("NVIDIA H100", "int8")


def test_metrics_reexports_the_table():
    assert metrics.peak_tflops_for_name is peak.peak_tflops_for_name
    assert metrics.default_peak_tflops is peak.default_peak_tflops


def test_default_peak_cuda_branch(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H100 PCIe")
    assert metrics.default_peak_tflops("cuda") == 756.0
    assert peak.default_peak_tflops("cuda", "fp32") == 51.0
    assert peak.default_peak_tflops("cuda", "fp8") == 1513.0
    assert metrics.default_peak_tflops("cpu") is None
