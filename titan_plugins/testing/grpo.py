"""What ``objective=grpo``'s tests share: a one-process :class:`JobView` over a model the
test built (the rollout stage and the loss run on it as in a one-rank run), the job
config the stage reads, and a ``rollout=file`` JSONL writer."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

__all__ = ["OneRankView", "grpo_job", "write_rollout_file"]


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
