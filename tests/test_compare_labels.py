"""titan-compare's plot: short labels (only the overrides that differ), the verdict
title and the tolerance line (titan_plugins/compare/labels.py, plot.py)."""

from __future__ import annotations

import pytest

from titan_plugins.compare import BITWISE, LOSS_PARITY, Curve, compare_curves
from titan_plugins.compare.labels import short_labels

SEED = "checkpoint.init_from=/tmp/titan-compare-x1y2/seed/checkpoints/seed"


def test_short_labels_keep_only_the_overrides_that_differ() -> None:
    common = ["model=qwen3", "training.steps=10", "training.deterministic=true"]
    base = [*common, "parallelism=single", SEED, "training.dump_final_params=true"]
    test = [*common, "parallelism=fsdp2_tp2", "training.local_batch_size=2", SEED.replace("x1y2", "z9")]
    assert short_labels(base, test) == ("parallelism=single", "parallelism=fsdp2_tp2 training.local_batch_size=2")


def test_short_labels_last_override_wins_and_long_labels_are_cut() -> None:
    assert short_labels(["precision=fp32", "precision=bf16_mixed"], ["precision=bf16_mixed"]) == (
        "same overrides", "same overrides")
    assert short_labels(["+data.path=a"], ["data.path=b"]) == ("data.path=a", "data.path=b")
    base, test = short_labels(["a=1"], ["a=1", *(f"key{i}=value{i}" for i in range(20))], limit=40)
    assert base == "(defaults)" and len(test) == 40 and test.endswith("...")


@pytest.mark.parametrize("tol, losses, title", [
    (LOSS_PARITY, [3.0, 2.5000001, 2.0], "PASS: loss within tolerance"),
    (BITWISE, [3.0, 2.5, 2.0], "PASS: losses bitwise equal"),
    (LOSS_PARITY, [3.0, 2.6, 2.0], "FAIL: loss diverges first at step 2"),
])
def test_plot_title_and_tolerance(tmp_path, monkeypatch, tol, losses, title) -> None:
    pytest.importorskip("matplotlib")
    import matplotlib.figure

    from titan_plugins.compare.plot import plot_curves

    seen = {}
    real = matplotlib.figure.Figure.savefig

    def savefig(fig, *args, **kwargs):  # look at the figure as it was written (laid out)
        real(fig, *args, **kwargs)
        seen["title"] = fig._suptitle.get_text()
        seen["lines"] = [line.get_label() for ax in fig.axes for line in ax.get_lines()]
        seen["axes"] = [ax.get_position().width for ax in fig.axes]

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", savefig)
    base = Curve(label="", overrides=["parallelism=single", SEED], losses=[3.0, 2.5, 2.0])
    test = Curve(label="", overrides=["parallelism=fsdp2", SEED], losses=losses)
    out = tmp_path / "p.png"
    plot_curves(base, test, str(out), verdict=compare_curves(base, test, loss_tol=tol, grad_tol=None),
                tolerance=tol)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert seen["title"].startswith(title)
    assert "baseline: parallelism=single" in seen["lines"] and "test: parallelism=fsdp2" in seen["lines"]
    assert ("tolerance (atol + rtol * |baseline|)" in seen["lines"]) == (tol is LOSS_PARITY)
    assert len(seen["axes"]) == 2 and min(seen["axes"]) > 0.8  # both panels span the width
