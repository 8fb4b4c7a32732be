"""The published flavors build on the meta device; their parameter counts are asserted."""

from __future__ import annotations

import pytest
import torch
from titan_deepseek_v3.config import FLAVORS, flops, param_counts
from titan_deepseek_v3.model import build


def counted(model: torch.nn.Module, top_k: int, num_experts: int) -> tuple[int, int]:
    total = active = 0
    for name, p in model.named_parameters():
        total += p.numel()
        active += p.numel() * top_k // num_experts if ".moe.experts." in name else p.numel()
    return total, active


@pytest.mark.parametrize(
    "flavor, total, active",
    [
        # DeepSeek-V3: 671B parameters, 37B activated per token (the paper's numbers).
        ("671B", 671_026_404_352, 37_552_282_624),
        # DeepSeek-V2-Lite shapes: 15.7B total, 2.66B active ("16B").
        ("16B", 15_706_484_224, 2_661_150_208),
        ("debugmodel", 33_014_016, 28_098_816),
    ],
)
def test_flavor_builds_on_meta_with_published_counts(flavor, total, active):
    config = FLAVORS[flavor]
    with torch.device("meta"):
        model = build(config)
    assert all(p.is_meta for p in model.parameters())
    moe = config.layer.moe
    assert counted(model, moe.top_k, moe.num_experts) == (total, active)
    counts = param_counts(config)
    assert (counts.total, counts.active) == (total, active)
    print(f"{flavor}: {total / 1e9:.2f}B total, {active / 1e9:.2f}B active per token")
    if flavor == "671B":
        assert round(total / 1e9) == 671 and round(active / 1e9) in (37, 38)
    if flavor == "16B":
        assert round(total / 1e9) == 16


def test_flops_follow_torchtitan_formula():
    config = FLAVORS["debugmodel"]
    n, per_token = flops(config, seq_len=128)
    counts = param_counts(config)
    att = config.layer.attention
    assert n == counts.total
    assert per_token == 6 * (counts.active - counts.embedding) + 6 * 6 * 16 * (128 + 64 + 128) * 128
    assert att.n_heads == 16
