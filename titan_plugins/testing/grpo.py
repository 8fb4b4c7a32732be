"""What ``objective=grpo``'s tests share: a one-process :class:`JobView` over a model the
test built (the rollout stage and the loss run on it as in a one-rank run), the job
config the stage reads, a ``rollout=file`` JSONL writer, and for launched runs the tiny
policy's overrides (``tiny_grpo_run``) and a launch that returns what a run logged
(``launch_grpo``)."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

__all__ = ["OneRankView", "grpo_job", "launch_grpo", "tiny_grpo_run", "write_rollout_file"]


def grpo_job(data_path: str | Path, tokenizer: str | Path | None, *, seq_len: int = 64, rollout: str = "file",
             rollout_path: str | Path | None = None, seed: int = 0) -> DictConfig:
    """The parts of a job the rollout stage reads (``data``, ``training``, ``rollout``)."""
    return OmegaConf.create({
        "data": {"name": "prompts", "path": str(data_path), "split": "train",
                 "tokenizer": None if tokenizer is None else str(tokenizer),
                 "prompts": {"prompt_field": "prompt", "template": None}},
        "training": {"seq_len": seq_len, "seed": seed},
        "rollout": {"name": rollout, "path": None if rollout_path is None else str(rollout_path)},
    })


class OneRankView:
    """A :class:`titan_plugins.objectives.job.JobView` of one process (no process group)."""

    def __init__(self, job: DictConfig, model: torch.nn.Module, objective: Any, run_dir: str | Path,
                 reference: Any = None) -> None:
        self.job = self.config = job
        self.model = SimpleNamespace(parts=[model], pp=False)
        self.objective, self.reference = objective, reference
        self.device, self.rank, self.accum, self.dp_group = torch.device("cpu"), 0, 1, None
        self.run_dir = str(run_dir)

    def loss_context(self) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()

    def step_rng(self, step: int) -> torch.Generator:
        from titan_plugins.objectives.job import step_seed

        return torch.Generator().manual_seed(step_seed(int(self.job.training.seed), self.rank, step))


def write_rollout_file(path: str | Path, lines: list[dict[str, Any]]) -> Path:
    """``rollout=file``'s JSONL: one line per prompt (``position`` or ``prompt``,
    ``completion_ids``, optional ``step`` and ``rewards``)."""
    path = Path(path)
    path.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
    return path


def tiny_grpo_run(*, max_completion_length: int = 12, local_batch_size: int = 1, lr: float = 0.01,
                  steps: int = 2) -> list[str]:
    """``titan-run`` overrides of a launched GRPO test: a 2-layer qwen3 of dim 64 on the
    shipped prompts, 4 completions each, rows of 64 tokens, the format reward (any
    completion that starts with a letter: a random policy earns it about half the time)."""
    return ["model=qwen3", "model.n_layers=2", "model.dim=64", "model.n_heads=4", "model.n_kv_heads=2",
            "model.head_dim=16", "model.hidden_dim=128", "model.enable_weight_tying=false",
            "metrics.tensorboard=false", "metrics.console=false", "objective=grpo", "data=prompts",
            "training.seq_len=64", f"objective.max_completion_length={max_completion_length}",
            "objective.num_generations=4", f"training.local_batch_size={local_batch_size}",
            "training.warmup_steps=0", f"training.lr={lr}", f"training.steps={steps}",
            "objective.reward_funcs=[format]", "+objective.reward_options.format.pattern='(?s)[a-z].*'"]


def launch_grpo(run_dir: str | Path, overrides: list[str], timeout: float = 600) -> tuple[list[dict[str, Any]], str]:
    """Launch ``overrides`` into ``run_dir``: its metrics.jsonl step records and its
    completions.jsonl text (the completions every rank sampled, in order)."""
    from titan_plugins.train.api import run

    run_dir = Path(run_dir)
    result = run(overrides, run_dir=run_dir, timeout=timeout)
    assert result.returncode == 0, f"{run_dir.name}: {result.error}\n{result.stderr[-3000:]}"
    metrics = [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "step" in r]
    return metrics, (run_dir / "completions.jsonl").read_text()
