"""Device peak table: per-variant lookup from the CUDA device name."""

import pytest
import torch

from titan_plugins.train import metrics


@pytest.mark.parametrize(
    ("name", "peak"),
    [
        ("NVIDIA H100 80GB HBM3", 989.0),
        ("NVIDIA H100 PCIe", 756.0),
        ("NVIDIA H100 NVL", 835.0),
        ("NVIDIA H200", 989.0),
        ("NVIDIA B200", 2250.0),
        ("NVIDIA A100-SXM4-80GB", 312.0),
        ("NVIDIA L40S", 362.0),
        ("NVIDIA L4", 121.0),
        ("AMD Instinct MI300X", 1307.0),
        ("AMD Instinct MI355X", 2500.0),
        ("Some Unknown GPU", None),
    ],
)
def test_peak_by_name(name, peak):
    assert metrics.peak_tflops_for_name(name) == peak


def test_default_peak_cuda_branch(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H100 PCIe")
    assert metrics.default_peak_tflops("cuda") == 756.0
    assert metrics.default_peak_tflops("cpu") is None
