"""titan_plugins.suggest: the one "did you mean" of the core."""

from __future__ import annotations

from titan_plugins.suggest import closest, did_you_mean


def test_closest_by_similarity_then_by_prefix() -> None:
    assert closest("tyo", ["toy", "qwen3"]) == "toy"  # a swapped pair
    assert closest("fp", ["bf16_mixed", "fp32"]) == "fp32"  # too short to be similar: a prefix
    assert closest("mixed", ["fp32", "bf16_mixed"]) == "bf16_mixed"  # contained
    assert closest("zzz", ["toy"]) is None and closest("", ["toy"]) is None


def test_did_you_mean_is_a_suffix() -> None:
    assert did_you_mean("stesp", ["steps", "lr"]) == "; did you mean 'steps'?"
    assert did_you_mean("zzz", ["steps"]) == ""
