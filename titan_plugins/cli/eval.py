"""titan-eval: run lm-eval tasks on a run's checkpoint or a Hugging Face folder.

    titan-eval outputs/2026-01-01/12-00-00 --tasks-dir my_tasks --tasks my_task
    titan-eval --hf my-qwen3 --model qwen3 --tasks-dir my_tasks --tasks a,b --limit 50

Local tasks only: ``--tasks-dir`` holds lm-eval task YAMLs (its bundled tasks are
not indexed), relative ``data_files`` resolve against that folder, and Hugging Face
hubs run offline (nothing is downloaded). Prints the results as JSON; exit 0, 2 on
bad input. Needs the ``eval`` extra (``lm-eval``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from pathlib import Path

from titan_plugins.errors import ConfigError, TitanError


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="titan-eval", description=__doc__.split("\n")[0].split(": ", 1)[1])
    p.add_argument("path", nargs="?", metavar="RUN_DIR_OR_CHECKPOINT")
    p.add_argument("--hf", metavar="DIR", help="a Hugging Face folder instead of a checkpoint (needs --model)")
    p.add_argument("--model", help="the registry name for --hf")
    p.add_argument("--tasks-dir", required=True, metavar="DIR", help="folder of lm-eval task YAMLs")
    p.add_argument("--tasks", required=True, help="comma-separated task names")
    p.add_argument("--limit", type=int, default=None, help="at most N documents per task")
    p.add_argument("--device", default="cpu")
    p.add_argument("--output", metavar="FILE", help="also write the results JSON here (a new file)")
    p.add_argument("--overwrite", action="store_true", help="replace --output if it exists")
    return p


@contextlib.contextmanager
def _offline_in(folder: Path):
    saved = {k: os.environ.get(k) for k in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE")}
    os.environ.update(HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1")
    cwd = os.getcwd()
    os.chdir(folder)
    try:
        yield
    finally:
        os.chdir(cwd)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return _run(args)
    except TitanError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return exc.exit_code


def _run(args: argparse.Namespace) -> int:
    if (args.path is None) == (args.hf is None):
        raise ConfigError("give either RUN_DIR_OR_CHECKPOINT or --hf DIR")
    if args.hf is not None and not args.model:
        raise ConfigError(f"--hf={args.hf}: --model NAME is required")
    if args.output and Path(args.output).exists() and not args.overwrite:  # before the long evaluation
        raise ConfigError(f"--output {args.output}: exists (pass --overwrite to replace it)")
    tasks_dir = Path(args.tasks_dir).resolve()
    if not tasks_dir.is_dir():
        raise ConfigError(f"--tasks-dir={args.tasks_dir}: no such folder")
    try:
        import lm_eval
        from lm_eval.tasks import TaskManager
    except ImportError:
        raise ConfigError("titan-eval needs lm-eval: pip install 'titan-plugins[eval]'") from None
    tasks = [t for t in args.tasks.split(",") if t]
    manager = TaskManager(include_path=str(tasks_dir), include_defaults=False)
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        raise ConfigError(f"--tasks={unknown[0]}: no such task in {args.tasks_dir} (has: {', '.join(manager.all_tasks)})")

    import torch

    from titan_plugins.generate.lm_eval_adapter import TitanLM
    from titan_plugins.generate.load import load_checkpoint, load_hf

    device = torch.device(args.device)
    loaded = load_hf(args.hf, args.model, device) if args.hf else load_checkpoint(args.path, device)
    max_length = int(getattr(loaded.model.config, "max_seq_len", 0) or loaded.job.training.seq_len)
    lm = TitanLM(loaded.model, loaded.tokenizer, max_length, device)
    with _offline_in(tasks_dir):
        results = lm_eval.simple_evaluate(model=lm, tasks=tasks, task_manager=manager, limit=args.limit,
                                          log_samples=False, bootstrap_iters=0)
    scores = {task: {k: v for k, v in metrics.items() if isinstance(v, (int, float))}
              for task, metrics in results["results"].items()}
    text = json.dumps({"source": str(loaded.source), "results": scores}, indent=2)
    print(text, flush=True)
    if args.output:
        Path(args.output).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
