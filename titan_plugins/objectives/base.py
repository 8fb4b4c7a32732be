"""The objective interface: what the train step and the validator call instead of a
loss of their own.

Per optimizer step the trainer asks the objective for each microbatch's ``count`` (the
unit its loss averages over: label tokens for SFT, pairs for DPO), sums it over the
accumulation microbatches and all-reduces it over data parallel, and hands the global
figure to ``loss`` as ``scale``. ``loss`` returns the microbatch's share of the
global-batch loss (a sum divided by ``scale``), so summing over microbatches and ranks,
as gradient accumulation and the DP gradient reduction do, gives the global mean at
any layout; and a dict of *sums* (the metrics' numerators) that the trainer adds up
the same way and hands to ``metrics`` once per step.

Losses come from the model's output only through ``titan_plugins.loss.token_loss``'s
``token_loss_sum`` / ``token_nll`` (how the logits are produced is that module's
business).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from titan_plugins.objectives.spec import DataKind, ObjectiveSpec

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from titan_plugins.objectives.job import JobView

__all__ = ["Objective"]


class Objective(ABC):
    """One training objective. Subclasses set ``supports_pipeline`` when their loss can
    run on the last pipeline stage from ``(output, labels)`` alone."""

    supports_pipeline: bool = False

    def __init__(self, config: Any = None, spec: ObjectiveSpec | None = None) -> None:
        self.config = config
        self.spec = spec or ObjectiveSpec(name=type(self).__name__, build=type(self))

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def data(self) -> DataKind:
        """The batches it trains on (``rows``, ``pairs`` or ``prompts``)."""
        return self.spec.data

    @property
    def needs_reference(self) -> bool:
        """Whether ``loss`` needs the reference model's output (a frozen copy, or the
        base under LoRA)."""
        return self.spec.needs_reference

    def describe(self) -> str:
        """What the run header says of it (its name and knobs)."""
        return self.name

    def check(self, job: DictConfig) -> None:  # noqa: B027 (optional hook)
        """Before launch: raise ``ConfigError`` in one line for a job it cannot train."""

    def count(self, labels: torch.Tensor) -> torch.Tensor:
        """This microbatch's share of the normaliser (default: label tokens)."""
        from titan_plugins.loss.token_loss import count_tokens

        return count_tokens(labels)

    def empty_message(self, job: DictConfig) -> str:
        """The error when a global batch counts 0 (the loss would be 0/0)."""
        return f"data.name={job.data.name}: a global batch has nothing to train on"

    def rollout(self, run: JobView, step: int, batches: list[Any]) -> list[Any]:
        """The rollout stage of an online objective: called by the train step with the
        step's batches (``step`` counting from 1) before their microbatches run, it
        returns the batches to train on (grpo: the prompts' completions, scored). The
        default trains on the batches as the data source made them."""
        return batches

    def loss_inputs(self, batch: Any) -> dict[str, Any]:
        """What ``loss`` takes from a microbatch besides its output and labels, as keyword
        arguments (grpo: ``rollout=`` the batch, with its advantages)."""
        return {}

    def reference_stats(self, output: torch.Tensor, labels: torch.Tensor) -> Any:
        """What ``loss`` needs of the reference's output (so its logits can go at once)."""
        return output

    @abstractmethod
    def loss(self, output: torch.Tensor, labels: torch.Tensor, *, scale: float,
             reference: Any = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """``(loss, sums)``: the microbatch's share of the global loss (divided by
        ``scale``, to backward) and the metrics' numerators over this microbatch."""

    def metrics(self, sums: dict[str, float], count: float) -> dict[str, float]:
        """The logged metrics of a step from the global ``sums`` and ``count``."""
        return {k: v / count for k, v in sums.items()}

    def validation_metrics(self, loss: float, sums: dict[str, float], count: float) -> dict[str, float]:
        """The validator's record: the held-out loss, its count and ``metrics``."""
        return {"loss": loss, **self.metrics(sums, count), "count": count}

    def pipeline_loss(self) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None:
        """The last stage's ``loss_fn(output, labels)`` under PP (None: PP refused)."""
        return None

    def set_scale(self, scale: float) -> None:  # noqa: B027 (only pipeline objectives need it)
        """The global count of this step, for ``pipeline_loss`` (set before the schedule runs)."""
