"""titan-compare's pieces in-process: tolerance policy, diff, report, JSON, plot."""

from __future__ import annotations

import json

import pytest

from titan_plugins.cli.compare import main as compare_main
from titan_plugins.compare import BITWISE, LOSS_PARITY, Curve, Tolerance, compare_curves
from titan_plugins.compare.plot import plot_curves
from titan_plugins.compare.report import format_report


def curve(losses, grads=None, label="x"):
    return Curve(label=label, overrides=[label], losses=list(losses), grad_norms=list(grads or []))


def test_bitwise_tolerance_rejects_last_bit():
    a = 2.5
    b = 2.5000000000000004  # the next float64 after 2.5
    assert BITWISE.allows(a, a)
    assert not BITWISE.allows(a, b)
    assert LOSS_PARITY.allows(a, b)


def test_first_divergence_named_and_fail_line():
    base = curve([3.0, 2.9, 2.8, 2.7])
    test = curve([3.0, 2.9, 2.81, 2.6])
    verdict = compare_curves(base, test, loss_tol=Tolerance(1e-4, 1e-5), grad_tol=None)
    assert not verdict.passed
    assert verdict.loss.first_divergence == 3
    text = format_report(base, test, verdict, "t")
    assert text.splitlines()[-1] == "FAIL: loss diverges first at step 3"
    assert verdict.loss.max_abs == pytest.approx(0.1)


def test_pass_line_and_stats():
    base = curve([3.0, 2.0], [1.0, 0.5])
    test = curve([3.0, 2.0000001], [1.0, 0.5000001])
    verdict = compare_curves(base, test, loss_tol=LOSS_PARITY, grad_tol=Tolerance(1e-3, 0))
    assert verdict.passed
    text = format_report(base, test, verdict, "t")
    assert text.splitlines()[-1] == "PASS"
    assert "grad_norm: max abs diff" in text


def test_step_count_mismatch_fails():
    verdict = compare_curves(curve([1.0, 1.0]), curve([1.0]), loss_tol=LOSS_PARITY, grad_tol=None)
    assert not verdict.passed


def test_export_import_round_trip_keeps_every_bit(tmp_path):
    losses = [7.6246337890625123, 1 / 3, 2.0000000000000004]
    c = curve(losses, [0.1, 0.2, 0.3])
    path = tmp_path / "ref.json"
    c.save(path)
    back = Curve.load(path)
    assert back.losses == losses  # exact, not approx
    assert json.loads(path.read_text())["format"] == 1


def test_import_rejects_unknown_format(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"format": 99, "label": "x"}))
    with pytest.raises(ValueError, match="unsupported curve format"):
        Curve.load(path)


def test_plot_is_a_png(tmp_path):
    out = tmp_path / "p.png"
    plot_curves(curve([3.0, 2.5, 2.0]), curve([3.0, 2.5, 2.1]), str(out))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_bad_input_is_one_line_exit_2(capsys):
    assert compare_main(["--test", "model=x", "--steps", "0", "--import", "nofile.json"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err
    assert compare_main(["--steps", "3"]) == 2
    assert "--test is required" in capsys.readouterr().err
