"""--plot: both curves, their difference against the tolerance, and the verdict.

One column per metric: the loss always, and every other checked metric that failed
(the gradient norm). Top panel: the two curves, labelled by the overrides that differ
between the sides (``labels.short_labels``). Bottom panel: ``|test - baseline|`` per
step with the allowed difference (``Tolerance.allowed``, which widens with the step)
drawn as a line; steps outside it are marked. The title says PASS or FAIL and why,
wrapped to the figure's width.
"""

from __future__ import annotations

import textwrap
from typing import Any

from titan_plugins.compare.curves import Curve
from titan_plugins.compare.labels import short_labels
from titan_plugins.compare.tolerances import BITWISE, Tolerance

__all__ = ["plot_curves"]

_PASS, _FAIL = "tab:green", "tab:red"
_COLUMN_WIDTH = 9.0  # inches per metric column
_TITLE_SIZE = 13


def _tol_text(tolerance: Tolerance | None) -> str:
    if tolerance is None:
        return ""
    return "bitwise" if tolerance == BITWISE else f"rtol={tolerance.rtol:g}, atol={tolerance.atol:g}"


def _title(verdict: Any, tolerance: Tolerance | None) -> tuple[str, str]:
    if verdict is None:
        return "loss: baseline vs test", "black"
    tol = _tol_text(tolerance)
    if verdict.passed:
        if tol == "bitwise":
            return "PASS: losses bitwise equal", _PASS
        return (f"PASS: loss within tolerance ({tol}, x N at step N)" if tol else "PASS"), _PASS
    reasons = []
    for series in (verdict.loss, verdict.grad_norm):
        if series is not None and not series.passed:
            step = series.first_divergence
            reasons.append(f"{series.name} diverges first at step {step}" if step
                           else f"{series.name} step counts differ")
    if verdict.params_ok is False:
        reasons.append("final parameters differ")
    why = "; ".join(reasons)
    if verdict.loss.passed:
        why = "loss within tolerance; " + why
    return f"FAIL: {why}" + (f" (loss {tol})" if tol else ""), _FAIL


def _metrics(baseline: Curve, test: Curve, verdict: Any, tolerance: Tolerance | None,
             grad_tolerance: Tolerance | None) -> list[tuple[str, list[float], list[float], Tolerance | None]]:
    """``(name, baseline values, test values, tolerance)`` for every panel column."""
    out = [("loss", baseline.losses, test.losses, tolerance)]
    grad = getattr(verdict, "grad_norm", None)
    if grad is not None and not grad.passed:
        out.append(("grad_norm", baseline.grad_norms, test.grad_norms, grad_tolerance))
    return out


def _draw(top: Any, bottom: Any, name: str, base: list[float], test: list[float], tolerance: Tolerance | None,
          labels: tuple[str, str]) -> None:
    from matplotlib.ticker import MaxNLocator

    n = min(len(base), len(test))
    steps = list(range(1, n + 1))
    diffs = [abs(t - b) for b, t in zip(base[:n], test[:n])]
    top.plot(range(1, len(base) + 1), base, label=f"baseline: {labels[0]}", marker="o", ms=4, color="tab:blue")
    top.plot(range(1, len(test) + 1), test, label=f"test: {labels[1]}", marker="x", ms=5, linestyle="--",
             color="tab:orange")
    top.set_ylabel(name)
    top.set_title(name, fontsize=11)
    top.legend(loc="best", fontsize=9, framealpha=0.9)
    top.grid(alpha=0.3)

    allowed = [tolerance.allowed(b, s) for s, b in zip(steps, base[:n])] if tolerance else []
    log = any(d > 0 for d in diffs) or any(a > 0 for a in allowed)
    floor = min([v for v in diffs + allowed if v > 0], default=1.0) / 10  # where 0 sits on a log axis
    shown = [d if d > 0 or not log else floor for d in diffs]
    bottom.plot(steps, shown, color="tab:purple", marker=".", ms=6, label="|test - baseline|")
    if allowed:
        if any(a > 0 for a in allowed):
            bottom.plot(steps, allowed, color="black", linestyle=":",
                        label="tolerance (atol + rtol * |baseline|)")
        else:
            bottom.text(0.01, 0.9, "tolerance: bitwise (any difference fails)", transform=bottom.transAxes,
                        fontsize=9, va="top")
        outside = [(s, v) for s, v, d, a in zip(steps, shown, diffs, allowed) if d > a]
        if outside:
            xs, ys = zip(*outside)
            bottom.scatter(xs, ys, color=_FAIL, zorder=3, s=40, label="outside tolerance")
    if log:
        bottom.set_yscale("log")
        if any(d == 0 for d in diffs):
            bottom.axhline(floor, color="grey", linewidth=0.5)
            bottom.text(0.99, floor, "equal (0)", transform=bottom.get_yaxis_transform(), ha="right",
                        va="bottom", fontsize=8, color="grey")
    bottom.set_ylabel(f"|test - baseline| ({name})")
    bottom.set_xlabel("step")
    bottom.xaxis.set_major_locator(MaxNLocator(integer=True))
    bottom.legend(loc="best", fontsize=9, framealpha=0.9)
    bottom.grid(alpha=0.3)


def plot_curves(
    baseline: Curve,
    test: Curve,
    path: str,
    *,
    verdict: Any = None,
    tolerance: Tolerance | None = None,
    grad_tolerance: Tolerance | None = None,
) -> None:
    """Write a PNG to ``path``. ``verdict`` (``compare_curves``' result) gives the
    title and which metrics failed; ``tolerance`` (the loss's) and ``grad_tolerance``
    the allowed-difference lines."""
    try:
        import matplotlib
    except ImportError:
        from titan_plugins.errors import ConfigError

        raise ConfigError(
            f"--plot {path}: needs matplotlib (pip install 'titan-plugins[plot]')"
        ) from None

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    labels = short_labels(baseline.overrides, test.overrides)
    metrics = _metrics(baseline, test, verdict, tolerance, grad_tolerance)
    width = _COLUMN_WIDTH * len(metrics)
    fig = plt.figure(figsize=(width, 6.5), layout="constrained")
    axes = fig.subplots(2, len(metrics), sharex=True, height_ratios=[3, 2], squeeze=False)
    for column, (name, base, other, tol) in enumerate(metrics):
        _draw(axes[0][column], axes[1][column], name, base, other, tol, labels)

    title, color = _title(verdict, tolerance)
    # About 0.6 em per character of a bold 13 pt title: wrap well inside the figure.
    per_line = max(20, int(width * 72 / (0.62 * _TITLE_SIZE)) - 6)
    fig.suptitle(textwrap.fill(title, per_line), color=color, fontsize=_TITLE_SIZE, fontweight="bold")
    fig.savefig(path, format="png", dpi=110)
    plt.close(fig)
