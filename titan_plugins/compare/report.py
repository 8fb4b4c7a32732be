"""The human-readable comparison: a per-step table and one PASS/FAIL line."""

from __future__ import annotations

from titan_plugins.compare.curves import Curve
from titan_plugins.compare.diff import SeriesDiff, Verdict


def _series_table(diff: SeriesDiff) -> list[str]:
    lines = [f"{'step':>5}  {diff.name + ' baseline':>22}  {diff.name + ' test':>22}  {'abs diff':>10}  {'rel diff':>10}"]
    for s in diff.steps:
        mark = "" if s.ok else "  <-- outside tolerance"
        lines.append(f"{s.step:>5}  {s.baseline:>22.15g}  {s.test:>22.15g}  {s.abs_diff:>10.3e}  {s.rel_diff:>10.3e}{mark}")
    lines.append(f"{diff.name}: max abs diff {diff.max_abs:.3e}, mean abs diff {diff.mean_abs:.3e}")
    if diff.length_mismatch:
        b, t = diff.length_mismatch
        lines.append(f"{diff.name}: baseline has {b} steps, test has {t}")
    return lines


def format_report(baseline: Curve, test: Curve, verdict: Verdict, tolerance_text: str) -> str:
    lines = [f"baseline: {baseline.label}", f"test:     {test.label}", f"tolerance: {tolerance_text}", ""]
    lines += _series_table(verdict.loss)
    if verdict.grad_norm is not None:
        lines += [""] + _series_table(verdict.grad_norm)
    if verdict.params_max_abs is not None:
        where = f" ({verdict.params_worst})" if verdict.params_worst else ""
        lines += ["", f"final parameters: max abs diff {verdict.params_max_abs:.3e}{where}"]
    lines.append("")
    if verdict.passed:
        lines.append("PASS")
    else:
        reasons = []
        for series in (verdict.loss, verdict.grad_norm):
            if series is not None and not series.passed:
                step = series.first_divergence
                reasons.append(
                    f"{series.name} diverges first at step {step}" if step else f"{series.name} step counts differ"
                )
        if verdict.params_ok is False:
            reasons.append("final parameters differ")
        lines.append("FAIL: " + "; ".join(reasons))
    return "\n".join(lines)
