"""--plot: both loss curves, their difference against the tolerance, and the verdict.

Top panel: the two loss curves, labelled by the overrides that differ between the
sides (``labels.short_labels``). Bottom panel: ``|test - baseline|`` per step with the
allowed difference ``atol + rtol * |baseline|`` drawn as a line; steps outside it are
marked. The title says PASS or FAIL. Both panels span the figure's width; the legend
sits inside the top panel.
"""

from __future__ import annotations

from typing import Any

from titan_plugins.compare.curves import Curve
from titan_plugins.compare.labels import short_labels
from titan_plugins.compare.tolerances import Tolerance

__all__ = ["plot_curves"]

_PASS, _FAIL = "tab:green", "tab:red"


def _title(verdict: Any, tolerance: Tolerance | None) -> tuple[str, str]:
    if verdict is None:
        return "loss: baseline vs test", "black"
    tol = ""
    if tolerance is not None:
        tol = "bitwise" if tolerance == Tolerance(0.0, 0.0) else f"rtol={tolerance.rtol:g}, atol={tolerance.atol:g}"
    if verdict.passed:
        if tol == "bitwise":
            return "PASS: losses bitwise equal", _PASS
        return f"PASS: loss within tolerance ({tol})" if tol else "PASS", _PASS
    step = verdict.loss.first_divergence
    why = f"loss diverges first at step {step}" if step else "see the report"
    if verdict.loss.passed:
        why = "loss within tolerance; grad norm or parameters differ (see the report)"
    return f"FAIL: {why}" + (f" ({tol})" if tol else ""), _FAIL


def plot_curves(
    baseline: Curve,
    test: Curve,
    path: str,
    *,
    verdict: Any = None,
    tolerance: Tolerance | None = None,
) -> None:
    """Write a PNG to ``path``. ``verdict`` (``compare_curves``' result) gives the
    title; ``tolerance`` (the loss tolerance) the allowed-difference line."""
    try:
        import matplotlib
    except ImportError:
        from titan_plugins.errors import ConfigError

        raise ConfigError(
            f"--plot {path}: needs matplotlib (pip install 'titan-plugins[plot]')"
        ) from None

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    base_label, test_label = short_labels(baseline.overrides, test.overrides)
    n = min(len(baseline.losses), len(test.losses))
    steps = list(range(1, n + 1))
    diffs = [abs(t - b) for b, t in zip(baseline.losses[:n], test.losses[:n])]

    fig = plt.figure(figsize=(9, 6.5), layout="constrained")
    top, bottom = fig.subplots(2, 1, sharex=True, height_ratios=[3, 2])
    top.plot(range(1, len(baseline.losses) + 1), baseline.losses, label=f"baseline: {base_label}",
             marker="o", ms=4, color="tab:blue")
    top.plot(range(1, len(test.losses) + 1), test.losses, label=f"test: {test_label}",
             marker="x", ms=5, linestyle="--", color="tab:orange")
    top.set_ylabel("loss")
    top.legend(loc="best", fontsize=9, framealpha=0.9)
    top.grid(alpha=0.3)

    allowed = [tolerance.atol + tolerance.rtol * abs(b) for b in baseline.losses[:n]] if tolerance else []
    log = any(d > 0 for d in diffs) or any(a > 0 for a in allowed)
    floor = min([v for v in diffs + allowed if v > 0], default=1.0) / 10  # where 0 sits on a log axis
    shown = [d if d > 0 or not log else floor for d in diffs]
    bottom.plot(steps, shown, color="tab:purple", marker=".", ms=6, label="|test - baseline|")
    if allowed:
        if any(a > 0 for a in allowed):
            bottom.plot(steps, allowed, color="black", linestyle=":", label="tolerance (atol + rtol * |baseline|)")
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
    bottom.set_ylabel("|test - baseline|")
    bottom.set_xlabel("step")
    bottom.xaxis.set_major_locator(MaxNLocator(integer=True))
    bottom.legend(loc="best", fontsize=9, framealpha=0.9)
    bottom.grid(alpha=0.3)

    title, color = _title(verdict, tolerance)
    fig.suptitle(title, color=color, fontsize=13, fontweight="bold")
    fig.savefig(path, format="png", dpi=110)
    plt.close(fig)
