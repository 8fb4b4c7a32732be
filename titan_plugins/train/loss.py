"""The loss: token cross-entropy summed over the local batch and divided by the
number of label tokens in the *global* batch (all DP ranks, all accumulation
microbatches), so gradient accumulation and data parallelism give the same loss
and the same gradients (the DP gradient reduction is a sum)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100

__all__ = ["IGNORE_INDEX", "GlobalTokenLoss", "count_tokens"]


def count_tokens(labels: torch.Tensor) -> torch.Tensor:
    return (labels != IGNORE_INDEX).sum()


class GlobalTokenLoss:
    """``loss(logits, labels) = sum CE(logits in fp32, labels) / global_tokens``.

    ``global_tokens`` is set by the trainer before each step. Logits may be a
    DTensor sharded on the vocab dim (call under ``loss_parallel()`` then).
    """

    def __init__(self) -> None:
        self.global_tokens: float = 1.0

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        loss = F.cross_entropy(
            logits.flatten(0, 1).float(), labels.flatten(0, 1), reduction="sum", ignore_index=IGNORE_INDEX
        )
        return loss / self.global_tokens
