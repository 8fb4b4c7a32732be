"""titan-compare: did a parallelism (or any config) change alter the numerics?

    titan-compare --baseline "model=qwen3 parallelism=single" \
                  --test "model=qwen3 parallelism=fsdp2_tp2" --steps 10

Exit code 0 on PASS, 1 on FAIL, 2 on bad input.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from titan_plugins.errors import TitanError


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="titan-compare",
        description="Run two configurations from the same weights and compare losses step by step.",
    )
    p.add_argument("--baseline", help="Hydra overrides of the reference run (quoted)")
    p.add_argument("--test", help="Hydra overrides of the run under test (quoted)")
    p.add_argument("--steps", type=int, default=10, help="steps to run on both sides (default 10)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--assert-equal", action="store_true", help="require bitwise-equal losses")
    mode.add_argument("--rtol", type=float, default=None, help="relative tolerance on the loss")
    p.add_argument("--atol", type=float, default=None, help="absolute tolerance on the loss")
    p.add_argument("--no-grad-norm", action="store_true", help="do not compare gradient norms")
    p.add_argument("--params", action="store_true", help="also compare the final full parameters")
    p.add_argument("--no-seed-checkpoint", action="store_true",
                   help="let each side initialise from the seed instead of one shared checkpoint "
                        "(always so with model.hf: both sides load the folder)")
    p.add_argument("--export", metavar="FILE", help="write the baseline curve to FILE (JSON)")
    p.add_argument("--import", dest="import_", metavar="FILE",
                   help="use a curve exported earlier as the baseline instead of running it")
    p.add_argument("--plot", metavar="FILE.png", help="draw both curves and their difference")
    p.add_argument("--workdir", help="where the runs write (default: a temporary directory)")
    return p


def _tolerances(args):
    from titan_plugins.compare.tolerances import (
        BITWISE,
        GRAD_NORM_PARITY,
        LOSS_PARITY,
        Tolerance,
    )

    if args.assert_equal:
        return BITWISE, (None if args.no_grad_norm else BITWISE), "bitwise equal (--assert-equal)"
    loss = Tolerance(
        rtol=LOSS_PARITY.rtol if args.rtol is None else args.rtol,
        atol=LOSS_PARITY.atol if args.atol is None else args.atol,
    )
    grad = None if args.no_grad_norm else GRAD_NORM_PARITY
    text = f"loss rtol={loss.rtol:g} atol={loss.atol:g}"
    if grad is not None:
        text += f"; grad norm rtol={grad.rtol:g} atol={grad.atol:g}"
    text += "; allowed at step N: N x (atol + rtol x |baseline|)"
    return loss, grad, text


def run_compare(args) -> int:
    from titan_plugins.compare import runner
    from titan_plugins.compare.curves import Curve
    from titan_plugins.compare.diff import compare_curves, compare_params
    from titan_plugins.compare.report import format_report
    from titan_plugins.compare.tolerances import BITWISE, PARAM_PARITY
    from titan_plugins.errors import ConfigError

    if args.test is None:
        raise ConfigError("--test is required: the Hydra overrides of the run under test")
    if args.import_ is None and args.baseline is None:
        raise ConfigError("--baseline is required unless --import FILE gives a recorded baseline")
    if args.steps < 1:
        raise ConfigError(f"--steps={args.steps} must be at least 1")
    if args.plot:
        import importlib.util

        if importlib.util.find_spec("matplotlib") is None:  # say so before running anything
            raise ConfigError(f"--plot {args.plot}: needs matplotlib (pip install 'titan-plugins[plot]')")
    loss_tol, grad_tol, tol_text = _tolerances(args)
    common = [f"training.steps={args.steps}", *runner.DETERMINISTIC]
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="titan-compare-"))
    used = [d for d in ("seed", "baseline", "test") if (workdir / d).exists()]
    if used:  # an earlier compare's runs would resume or mix their records into this one's
        raise ConfigError(f"--workdir {workdir}: holds an earlier compare's {used[0]}/ run; give a new "
                          "or empty folder (its runs would be resumed and their metrics mixed in)")
    workdir.mkdir(parents=True, exist_ok=True)

    test_overrides = runner.split_overrides(args.test) + common
    if args.import_:
        try:
            baseline = Curve.load(args.import_)
        except (OSError, ValueError) as exc:
            raise ConfigError(f"--import {args.import_}: {exc}") from exc
        baseline_overrides = baseline.overrides
    else:
        baseline_overrides = runner.split_overrides(args.baseline) + common
    test_overrides, note = runner.match_global_batch(baseline_overrides, test_overrides)
    if note:
        print(note)

    from titan_plugins.compare.labels import short_labels

    hf = runner.hf_folder(_without_seed(baseline_overrides)) or runner.hf_folder(_without_seed(test_overrides))
    if hf and not args.no_seed_checkpoint:
        # The seed checkpoint would hold a fresh initialisation, not the folder's weights.
        print(f"note: both sides start from the weights of model.hf={hf} (no seed checkpoint)")
    if not args.no_seed_checkpoint and not hf:
        seed = runner.make_seed_checkpoint(_without_seed(baseline_overrides), workdir)
        seed_override = f"checkpoint.init_from={seed}"
        test_overrides = [*_without_seed(test_overrides), seed_override]
        if not args.import_:
            baseline_overrides = [*_without_seed(baseline_overrides), seed_override]

    base_label, test_label = short_labels(baseline_overrides, test_overrides)
    if not args.import_:
        baseline = runner.run_side("baseline", baseline_overrides, workdir, with_params=args.params,
                                   steps=args.steps, describe=base_label)
    test = runner.run_side("test", test_overrides, workdir, with_params=args.params,
                           steps=args.steps, describe=test_label)
    if args.export:
        baseline.save(args.export)
        print(f"baseline curve written to {args.export}")

    verdict = compare_curves(baseline, test, loss_tol=loss_tol, grad_tol=grad_tol)
    if args.params:
        if baseline.params_file and test.params_file:
            tol = BITWISE if args.assert_equal else PARAM_PARITY
            worst, ok, where = compare_params(baseline.params_file, test.params_file, tol)
            verdict.params_max_abs, verdict.params_ok, verdict.params_worst = worst, ok, where
        else:
            print("note: final parameters not available on both sides; not compared")
    if args.plot:
        from titan_plugins.compare.plot import plot_curves

        plot_curves(baseline, test, args.plot, verdict=verdict, tolerance=loss_tol, grad_tolerance=grad_tol)
        print(f"plot written to {args.plot}")
    print(format_report(baseline, test, verdict, tol_text))  # the verdict is the last line
    return 0 if verdict.passed else 1


def _without_seed(overrides: list[str]) -> list[str]:
    return [o for o in overrides if not o.startswith("checkpoint.init_from=")]


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return run_compare(args)
    except TitanError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
