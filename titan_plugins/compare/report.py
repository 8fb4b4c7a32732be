"""The human-readable comparison: a per-step table per metric and one PASS/FAIL line."""

from __future__ import annotations

from titan_plugins.compare.curves import Curve
from titan_plugins.compare.diff import SeriesDiff, Verdict

_VALUE = ".7g"  # enough digits to see a last-bit loss difference of fp32 (1 ulp ~ 1e-7 relative)
_DIFF = ".2e"


def _table(rows: list[list[str]]) -> list[str]:
    """Columns right-aligned to their widest cell, two spaces apart; the last one (the
    mark) left-aligned; a rule under the header."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    last = len(widths) - 1 if len(widths) > 6 else None

    def line(cells: list[str]) -> str:
        padded = (c.ljust(w) if i == last else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))
        return "  ".join(padded).rstrip()

    return [line(rows[0]), line(["-" * w for w in widths]), *(line(row) for row in rows[1:])]


def _series_table(diff: SeriesDiff) -> list[str]:
    marks = not diff.passed  # a last column only where some step is outside
    rows = [[str(s.step), format(s.baseline, _VALUE), format(s.test, _VALUE), format(s.abs_diff, _DIFF),
             format(s.rel_diff, _DIFF), format(s.allowed, _DIFF)] + (["" if s.ok else "<-- outside"] * marks)
            for s in diff.steps]
    headers = ["step", f"{diff.name} baseline", f"{diff.name} test", "abs diff", "rel diff", "allowed"]
    lines = _table([headers + ["tolerance"] * marks, *rows])
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
