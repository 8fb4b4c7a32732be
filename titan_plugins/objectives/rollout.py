"""The rollout stage of an online objective: where completions come from and what the
step trains on afterwards.

An engine (``rollout=<name>``) turns one microbatch's prompts into completions:
``complete(run, step, micro, rows, num_generations) -> Completions``, the completions'
token ids in TRL's order (the ``num_generations`` completions of the first prompt, then
the second's, ...) and, where it knows them, rewards by reward name. Engines are named
here and imported only when chosen; a later engine (a server, vLLM) is one more module
and one more line in :data:`ENGINES`.

:func:`training_rows` lays ``prompt + completion`` out as the step's rows (inputs and
labels, the labels on the completion only, the EOS included), and :class:`RolloutBatch`
carries them with what the loss needs besides (advantages, the sampling policy's
log-probs).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from titan_plugins.errors import ConfigError
from titan_plugins.loss.token_loss import IGNORE_INDEX
from titan_plugins.spec import resolve

if TYPE_CHECKING:
    from titan_plugins.data.prompt_source import PromptRow
    from titan_plugins.objectives.job import JobView

__all__ = ["ENGINES", "Completions", "RolloutBatch", "RolloutEngine", "build_engine", "is_truncated",
           "rollout_group", "row_width", "samples_from_the_policy", "training_rows", "write_completions"]

ENGINES = {
    "native": "titan_plugins.objectives.rollout_native:NativeRollout",
    "file": "titan_plugins.objectives.rollout_file:FileRollout",
    "vllm": "titan_plugins.objectives.rollout_vllm:VLLMRollout",
}


@dataclass
class Completions:
    """One microbatch's completions (``ids``, group-major) and the rewards an engine
    already knows (``rewards[name]``, one value or None per completion)."""

    ids: list[list[int]]
    rewards: dict[str, list[Any]] | None = None


class RolloutEngine(Protocol):
    name: str

    def complete(self, run: JobView, step: int, micro: int, rows: list[PromptRow],
                 num_generations: int) -> Completions:
        """The completions of ``rows`` (each prompt ``num_generations`` times)."""
        ...


def build_engine(job: Any, objective: Any) -> RolloutEngine:
    """The engine ``rollout.name`` names, built from the job and the objective's knobs."""
    rollout = job.get("rollout") if hasattr(job, "get") else getattr(job, "rollout", None)
    name = str(getattr(rollout, "name", None) or "native")
    if name not in ENGINES:
        raise ConfigError(f"rollout.name={name}: expected one of {', '.join(ENGINES)}")
    return resolve(ENGINES[name])(job, objective)


def samples_from_the_policy(job: Any) -> bool:
    """Whether the run decodes with the training model and its KV cache: an online
    objective (one with a rollout stage) on ``rollout=native``."""
    from titan_plugins.objectives.base import Objective
    from titan_plugins.objectives.registry import build_objective

    objective = build_objective(job.get("objective"))
    if type(objective).rollout is Objective.rollout:
        return False
    rollout = job.get("rollout")
    return str(getattr(rollout, "name", None) or "native") == "native"


def rollout_group(run: Any) -> Any:
    """The ranks a rollout's agreements and metrics span: data parallel, and under context
    parallel its cp peers too (they hold the same rows, and other tokens of them)."""
    from titan_plugins.distributed.context_parallel import context_parallel

    cp = context_parallel(getattr(run, "dims", None))
    return run.dp_group if cp is None else cp.loss_group


def is_truncated(ids: list[int], stops: set[int]) -> bool:
    """TRL's rule: a completion is truncated when it ends in neither an EOS id nor padding."""
    return not ids or ids[-1] not in stops


class RolloutBatch(tuple):
    """``(inputs, labels)`` of completions, with ``advantages [rows]`` and
    ``old_logps [rows, seq]`` (None: the policy's own, detached: ``num_iterations=1``)."""

    doc_ids = None

    def __new__(cls, inputs: torch.Tensor, labels: torch.Tensor, advantages: torch.Tensor,
                old_logps: torch.Tensor | None = None) -> RolloutBatch:
        batch = super().__new__(cls, (inputs, labels))
        batch.advantages, batch.old_logps = advantages, old_logps
        return batch

    def positions(self, index: torch.Tensor) -> RolloutBatch:
        """The batch at positions ``index`` of its rows (context parallel's shard): the
        advantages are per row and stay whole."""
        cut = lambda x: x.index_select(1, index.to(x.device))  # noqa: E731
        return RolloutBatch(cut(self[0]), cut(self[1]), self.advantages,
                            None if self.old_logps is None else cut(self.old_logps))


def row_width(prompts: list[list[int]], completions: list[list[int]]) -> int:
    """The positions the longest ``prompt + completion`` needs as a training row."""
    return max(len(p) + len(c) for p, c in zip(prompts, completions, strict=True)) - 1


def training_rows(prompts: list[list[int]], completions: list[list[int]], masked: list[bool],
                  pad_id: int, width: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(inputs, labels)`` ``[rows, width]`` (``width`` at least ``row_width``, by default
    that): row ``i`` is ``prompts[i] + completions[i]`` shifted as a causal LM reads it,
    right-padded; labels on the completion's tokens (none for a ``masked`` completion:
    TRL's ``mask_truncated_completions``)."""
    width = max(width or 0, row_width(prompts, completions))
    inputs = torch.full((len(prompts), width), pad_id, dtype=torch.int64)
    labels = torch.full((len(prompts), width), IGNORE_INDEX, dtype=torch.int64)
    for i, (p, c) in enumerate(zip(prompts, completions, strict=True)):
        ids = p + c
        inputs[i, : len(ids) - 1] = torch.tensor(ids[:-1])
        if not masked[i]:
            labels[i, len(p) - 1: len(ids) - 1] = torch.tensor(c)
    return inputs, labels


def write_completions(run_dir: str, records: list[dict[str, Any]]) -> None:
    """Append ``records`` to ``<run_dir>/completions.jsonl`` (rank 0's job)."""
    path = Path(run_dir) / "completions.jsonl"
    with path.open("a", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record, ensure_ascii=False, default=str) + "\n")
