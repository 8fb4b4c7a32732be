"""titan-compare's tolerance over a run, its tables, plot and progress (issue 25, item 2)."""

from __future__ import annotations

import json
import re

import pytest

from titan_plugins.compare import GRAD_NORM_PARITY, LOSS_PARITY, Curve, Tolerance, compare_curves
from titan_plugins.compare.report import format_report

# Measured: `titan-compare --baseline "model=qwen3 parallelism=single" --test "model=qwen3
# parallelism=fsdp2" --steps 8` (CPU, gloo). Resumed from the baseline's step-7 checkpoint,
# both layouts give step 8's gradient norm to 2.7e-5 (3.768473 vs 3.768573): the backward
# is the same. 2.4e-3 here comes from weights 7 steps of reordering apart.
ISSUE_LOSSES = (
    [8.07043743133545, 7.901878356933594, 7.151787757873535, 7.69942569732666, 7.390195846557617,
     7.4568610191345215, 6.948492050170898, 6.681726932525635],
    [8.070438385009766, 7.901878356933594, 7.151787757873535, 7.699425220489502, 7.390194892883301,
     7.45686149597168, 6.948490619659424, 6.681724548339844],
)
ISSUE_GRAD_NORMS = (
    [17.601015090942383, 27.089330673217773, 6.059724807739258, 14.256536483764648, 2.3837344646453857,
     2.758474826812744, 1.47378671169281, 3.768472909927368],
    [17.6010799407959, 27.089448928833008, 6.059800148010254, 14.256714820861816, 2.3837969303131104,
     2.7585792541503906, 1.4738229513168335, 3.759585380554199],
)


def _curves(losses, grads):
    return (Curve(label="b", overrides=["parallelism=single"], losses=losses[0], grad_norms=grads[0]),
            Curve(label="t", overrides=["parallelism=fsdp2"], losses=losses[1], grad_norms=grads[1]))


def test_reordering_drift_over_a_run_is_not_a_failure() -> None:
    base, test = _curves(ISSUE_LOSSES, ISSUE_GRAD_NORMS)
    verdict = compare_curves(base, test, loss_tol=LOSS_PARITY, grad_tol=GRAD_NORM_PARITY)
    assert verdict.passed, format_report(base, test, verdict, "")


def test_a_backward_difference_at_step_1_still_fails() -> None:
    # Same weights and batch at step 1: 2e-3 apart is no reordering (measured 4e-6).
    grads = (ISSUE_GRAD_NORMS[0], [ISSUE_GRAD_NORMS[0][0] * 1.002, *ISSUE_GRAD_NORMS[1][1:]])
    base, test = _curves(ISSUE_LOSSES, grads)
    verdict = compare_curves(base, test, loss_tol=LOSS_PARITY, grad_tol=GRAD_NORM_PARITY)
    assert not verdict.passed and verdict.grad_norm.first_divergence == 1
    assert Tolerance(1e-4, 0.0).allowed(2.0, step=3) == pytest.approx(6e-4)


def test_tables_print_a_readable_number_of_digits() -> None:
    base, test = _curves(ISSUE_LOSSES, ISSUE_GRAD_NORMS)
    text = format_report(base, test, compare_curves(base, test, loss_tol=LOSS_PARITY, grad_tol=GRAD_NORM_PARITY), "")
    rows = [line.split() for line in text.splitlines() if line.split()[:1] and line.split()[0].isdigit()]
    assert len(rows) == 16
    assert rows[0][:3] == ["1", "8.070437", "8.070438"]  # 7 significant digits: the last fp32 bit shows
    digits = [len(re.sub(r"[^0-9]", "", v.split("e")[0]).lstrip("0")) for row in rows for v in row[1:]]
    assert max(digits) <= 7


def test_plot_shows_every_failed_metric_and_its_title_fits(tmp_path, monkeypatch) -> None:
    pytest.importorskip("matplotlib")
    import matplotlib.figure

    from titan_plugins.compare.plot import plot_curves

    seen = {}
    real = matplotlib.figure.Figure.savefig

    def savefig(fig, *args, **kwargs):
        real(fig, *args, **kwargs)
        renderer = fig.canvas.get_renderer()
        seen["title"] = fig._suptitle.get_text()
        seen["title_box"], seen["fig_box"] = fig._suptitle.get_window_extent(renderer), fig.bbox
        seen["ylabels"] = [ax.get_ylabel() for ax in fig.axes]

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", savefig)
    long = [f"parallelism.option_number_{i}=a_rather_long_value_{i}" for i in range(6)]
    base = Curve(label="", overrides=["parallelism=single", *long], losses=[3.0, 2.5, 2.0], grad_norms=[1.0, 0.9, 0.8])
    test = Curve(label="", overrides=["parallelism=fsdp2"], losses=[3.0, 2.5, 2.0], grad_norms=[1.1, 0.9, 0.8])
    grad_tol = Tolerance(rtol=1e-3, atol=1e-5)
    verdict = compare_curves(base, test, loss_tol=LOSS_PARITY, grad_tol=grad_tol)
    assert verdict.loss.passed and not verdict.grad_norm.passed
    plot_curves(base, test, str(tmp_path / "p.png"), verdict=verdict, tolerance=LOSS_PARITY,
                grad_tolerance=grad_tol)
    assert "grad_norm diverges first at step 1" in seen["title"].replace("\n", " ")
    assert any("grad_norm" in label for label in seen["ylabels"]) and len(seen["ylabels"]) == 4
    box, fig_box = seen["title_box"], seen["fig_box"]
    assert fig_box.x0 <= box.x0 and box.x1 <= fig_box.x1, (box, fig_box)  # no edge cut off

    # One column (the loss alone failed) and the longest title: still inside the figure.
    test.losses = [3.0, 2.6, 2.0]
    odd = Tolerance(rtol=1.2345e-5, atol=6.789e-6)  # the longest numbers in the title
    verdict = compare_curves(base, test, loss_tol=odd, grad_tol=None)
    verdict.params_ok, verdict.params_max_abs = False, 1.0
    plot_curves(base, test, str(tmp_path / "q.png"), verdict=verdict, tolerance=odd)
    assert len(seen["ylabels"]) == 2 and "final parameters differ" in seen["title"].replace("\n", " ")
    box, fig_box = seen["title_box"], seen["fig_box"]
    assert fig_box.x0 <= box.x0 and box.x1 <= fig_box.x1, (box, fig_box)


def test_progress_says_side_and_step(tmp_path, capsys) -> None:
    from titan_plugins.compare.runner import progress

    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text(json.dumps({"step": 9, "loss": 1.0}) + "\n")  # an earlier run in a reused workdir
    with progress("baseline", tmp_path, 2, every=0.01):
        with open(metrics, "a") as f:
            for step in (1, 2):
                f.write(json.dumps({"step": step, "loss": 2.0 / step}) + "\n")
                f.write(json.dumps({"validation_step": step, "loss": 5.0}) + "\n")
    err = capsys.readouterr().err
    assert "baseline: step 1/2, loss 2.0000" in err and "baseline: step 2/2, loss 1.0000" in err
    assert "step 9" not in err and err.count("step ") == 2
    assert "baseline: finished in" in err


def test_a_model_hf_compare_starts_both_sides_from_the_folder(tmp_path, monkeypatch, capsys) -> None:
    from titan_plugins.cli.compare import main
    from titan_plugins.compare import runner

    sides = {}

    def run_side(label, overrides, workdir, **_):
        sides[label] = overrides
        return Curve(label=label, overrides=overrides, losses=[1.0], grad_norms=[1.0])

    def no_seed(*_a, **_k):
        raise AssertionError("a seed checkpoint would replace the folder's weights")

    monkeypatch.setattr(runner, "run_side", run_side)
    monkeypatch.setattr(runner, "make_seed_checkpoint", no_seed)
    folder = tmp_path / "hf"  # composing reads no file; the runs are replaced above
    rc = main(["--baseline", f"model=qwen3 model.hf={folder} parallelism=single",
               "--test", f"model=qwen3 model.hf={folder} parallelism=fsdp2", "--steps", "1",
               "--workdir", str(tmp_path / "work")])
    assert rc == 0
    assert not any(o.startswith("checkpoint.init_from=") for side in sides.values() for o in side)
    assert f"both sides start from the weights of model.hf={folder}" in capsys.readouterr().out


def test_a_reused_workdir_is_refused_before_any_run(tmp_path, monkeypatch, capsys) -> None:
    # Its runs would resume the earlier compare's checkpoints and mix in its metrics.
    from titan_plugins.cli.compare import main
    from titan_plugins.compare import runner

    def no_run(*_a, **_k):
        raise AssertionError("a run started")

    monkeypatch.setattr(runner, "run_side", no_run)
    monkeypatch.setattr(runner, "make_seed_checkpoint", no_run)
    (tmp_path / "work" / "baseline").mkdir(parents=True)
    rc = main(["--baseline", "model=qwen3 parallelism=single", "--test", "model=qwen3 parallelism=fsdp2",
               "--steps", "1", "--workdir", str(tmp_path / "work")])
    assert rc == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: --workdir") and "earlier compare's baseline/ run" in err[-1]
