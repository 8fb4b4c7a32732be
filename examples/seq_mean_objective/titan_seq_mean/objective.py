"""``objective=seq_mean``: the mean over the global batch's sequences of each sequence's
mean token NLL, so a short answer counts as much as a long one (plain SFT weighs tokens).

The contract in practice: the per-token losses come from ``token_nll`` (never from the
logits); ``count`` is what the loss averages over (here: rows with at least one label),
summed over the global batch by the trainer and handed back as ``scale``; ``loss``
returns this microbatch's share (a sum divided by ``scale``); the metric dict holds
sums, which the trainer adds up over microbatches and ranks."""

from __future__ import annotations

from typing import Any

import torch

from titan_plugins.loss.token_loss import IGNORE_INDEX, token_nll
from titan_plugins.objectives.base import Objective

__all__ = ["SequenceMeanSFT"]


class SequenceMeanSFT(Objective):
    def count(self, labels: torch.Tensor) -> torch.Tensor:
        return ((labels != IGNORE_INDEX).sum(-1) > 0).sum()

    def empty_message(self, job: Any) -> str:
        return f"data.name={job.data.name}: a global batch has no row with a label (objective.name=seq_mean)"

    def loss(self, output: torch.Tensor, labels: torch.Tensor, *, scale: Any,
             reference: Any = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        tokens = (labels != IGNORE_INDEX).sum(-1)
        per_row = token_nll(output, labels).sum(-1) / tokens.clamp(min=1)  # 0 for a row without labels
        weight = float(self.config.options.get("weight", 1.0)) if self.config is not None else 1.0
        loss = weight * per_row.sum() / scale
        return loss, {"seq_mean/tokens_per_row": tokens.sum().to(torch.float64)}
