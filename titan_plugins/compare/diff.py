"""Step-by-step comparison of two curves and the verdict."""

from __future__ import annotations

from dataclasses import dataclass, field

from titan_plugins.compare.curves import Curve
from titan_plugins.compare.tolerances import Tolerance


@dataclass
class StepDiff:
    step: int
    baseline: float
    test: float
    ok: bool
    allowed: float = 0.0  # the largest |test - baseline| the tolerance allows at this step

    @property
    def abs_diff(self) -> float:
        return abs(self.test - self.baseline)

    @property
    def rel_diff(self) -> float:
        return self.abs_diff / abs(self.baseline) if self.baseline else float("inf") if self.abs_diff else 0.0


@dataclass
class SeriesDiff:
    name: str
    steps: list[StepDiff] = field(default_factory=list)
    length_mismatch: tuple[int, int] | None = None

    @property
    def passed(self) -> bool:
        return self.length_mismatch is None and all(s.ok for s in self.steps)

    @property
    def first_divergence(self) -> int | None:
        return next((s.step for s in self.steps if not s.ok), None)

    @property
    def max_abs(self) -> float:
        return max((s.abs_diff for s in self.steps), default=0.0)

    @property
    def mean_abs(self) -> float:
        return sum(s.abs_diff for s in self.steps) / len(self.steps) if self.steps else 0.0


def compare_series(name: str, baseline: list[float], test: list[float], tol: Tolerance) -> SeriesDiff:
    diff = SeriesDiff(name)
    if len(baseline) != len(test):
        diff.length_mismatch = (len(baseline), len(test))
    for i, (b, t) in enumerate(zip(baseline, test), start=1):
        diff.steps.append(StepDiff(i, b, t, tol.allows(b, t, step=i), tol.allowed(b, step=i)))
    return diff


@dataclass
class Verdict:
    loss: SeriesDiff
    grad_norm: SeriesDiff | None = None
    params_max_abs: float | None = None
    params_ok: bool | None = None
    params_worst: str | None = None

    @property
    def passed(self) -> bool:
        checks = [self.loss.passed]
        if self.grad_norm is not None:
            checks.append(self.grad_norm.passed)
        if self.params_ok is not None:
            checks.append(self.params_ok)
        return all(checks)


def compare_curves(
    baseline: Curve, test: Curve, *, loss_tol: Tolerance, grad_tol: Tolerance | None
) -> Verdict:
    verdict = Verdict(loss=compare_series("loss", baseline.losses, test.losses, loss_tol))
    if grad_tol is not None and baseline.grad_norms and test.grad_norms:
        verdict.grad_norm = compare_series("grad_norm", baseline.grad_norms, test.grad_norms, grad_tol)
    return verdict


def compare_params(baseline_file: str, test_file: str, tol: Tolerance) -> tuple[float, bool, str | None]:
    """Max abs difference over every full parameter tensor saved by the two runs."""
    import torch

    a = torch.load(baseline_file, map_location="cpu", weights_only=True)
    b = torch.load(test_file, map_location="cpu", weights_only=True)
    if set(a) != set(b):
        missing = sorted(set(a) ^ set(b))[:3]
        return float("inf"), False, f"parameter names differ: {missing}"
    worst_name, worst = None, 0.0
    for name in sorted(a):
        if a[name].shape != b[name].shape:
            return float("inf"), False, f"{name}: shape {tuple(a[name].shape)} vs {tuple(b[name].shape)}"
        d = (a[name].double() - b[name].double()).abs().max().item() if a[name].numel() else 0.0
        if d > worst:
            worst_name, worst = name, d
    ok = worst <= tol.atol
    return worst, ok, worst_name
