"""``objective=sft`` (the default): next-token cross-entropy summed over the labelled
tokens and divided by the labelled tokens of the whole global batch. The same
operations as before objectives existed (``GlobalTokenLoss``), so losses are bitwise
those of earlier runs."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from titan_plugins.loss.token_loss import GlobalTokenLoss
from titan_plugins.objectives.base import Objective

if TYPE_CHECKING:
    from omegaconf import DictConfig

__all__ = ["SFTObjective"]


class SFTObjective(Objective):
    supports_pipeline = True

    def __init__(self, config: Any = None, spec: Any = None) -> None:
        super().__init__(config, spec)
        if spec is None:
            from titan_plugins.objectives.registry import BUILTIN_OBJECTIVES

            self.spec = BUILTIN_OBJECTIVES[0]
        self._loss = GlobalTokenLoss()  # also the pipeline schedule's loss_fn

    def empty_message(self, job: DictConfig) -> str:
        return (f"data.name={job.data.name}: a global batch has no trainable token (every label "
                "is masked): the loss would be 0/0; check data.chat.train_on and the data")

    def set_scale(self, scale: float) -> None:
        self._loss.global_tokens = scale

    def loss(self, output: torch.Tensor, labels: torch.Tensor, *, scale: float,
             reference: Any = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        self._loss.global_tokens = scale
        return self._loss(output, labels), {}

    def pipeline_loss(self) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        return self._loss

    def validation_metrics(self, loss: float, sums: dict[str, float], count: float) -> dict[str, float]:
        return {"loss": loss, "perplexity": math.exp(min(loss, 700.0)), "tokens": count}
