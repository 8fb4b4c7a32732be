"""--plot: both loss curves and their difference, for people who would rather look."""

from __future__ import annotations

from titan_plugins.compare.curves import Curve


def plot_curves(baseline: Curve, test: Curve, path: str) -> None:
    try:
        import matplotlib
    except ImportError:
        from titan_plugins.errors import ConfigError

        raise ConfigError(
            f"--plot {path}: needs matplotlib (pip install 'titan-plugins[plot]')"
        ) from None

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    steps_b = range(1, len(baseline.losses) + 1)
    steps_t = range(1, len(test.losses) + 1)
    n = min(len(baseline.losses), len(test.losses))
    diffs = [abs(t - b) for b, t in zip(baseline.losses[:n], test.losses[:n])]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    top.plot(steps_b, baseline.losses, label=f"baseline: {baseline.label}", marker="o", ms=3)
    top.plot(steps_t, test.losses, label=f"test: {test.label}", marker="x", ms=3, linestyle="--")
    top.set_ylabel("loss")
    top.legend(fontsize=7)
    bottom.plot(range(1, n + 1), diffs, color="tab:red", marker=".")
    bottom.set_ylabel("|test - baseline|")
    bottom.set_xlabel("step")
    if any(d > 0 for d in diffs):
        bottom.set_yscale("log")
    fig.tight_layout()
    fig.savefig(path, format="png")
    plt.close(fig)
