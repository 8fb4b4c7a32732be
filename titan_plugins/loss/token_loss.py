"""The loss: token cross-entropy summed over the local batch and divided by the
number of label tokens in the *global* batch (all DP ranks, all accumulation
microbatches), so gradient accumulation and data parallelism give the same loss
and the same gradients (the DP gradient reduction is a sum)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from titan_plugins.loss.fused import chunked_ce, head_ref

IGNORE_INDEX = -100

__all__ = ["IGNORE_INDEX", "GlobalTokenLoss", "count_tokens", "token_loss_sum", "token_nll"]


def count_tokens(labels: torch.Tensor) -> torch.Tensor:
    return (labels != IGNORE_INDEX).sum()


def token_loss_sum(output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of the token cross-entropies (fp32) over the positions whose label counts.

    ``output`` is what the model's last part returned. Objectives compute their losses
    only through this function and :func:`token_nll`, never from logits directly, so
    that how the logits are produced (whole, or in chunks fused with the head) stays
    this module's business: a deferred head's hidden states (loss/fused.py)
    take the chunked path, whole logits the plain one."""
    ref = head_ref(output)
    if ref is not None:
        return chunked_ce(output, labels, ref, ignore_index=IGNORE_INDEX, reduction="sum")
    return F.cross_entropy(
        output.flatten(0, 1).float(), labels.flatten(0, 1), reduction="sum", ignore_index=IGNORE_INDEX
    )


def token_nll(output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per-position cross-entropy ``[batch, seq]`` in fp32, 0 where the label is
    ``IGNORE_INDEX`` (the negative token log-probabilities preference losses sum)."""
    ref = head_ref(output)
    if ref is not None:
        return chunked_ce(output, labels, ref, ignore_index=IGNORE_INDEX, reduction="none")
    nll = F.cross_entropy(
        output.flatten(0, 1).float(), labels.flatten(0, 1), reduction="none", ignore_index=IGNORE_INDEX
    )
    return nll.view(labels.shape)


class GlobalTokenLoss:
    """``loss(logits, labels) = sum CE(logits in fp32, labels) / global_tokens``.

    ``global_tokens`` is set by the trainer before each step. Logits may be a
    DTensor sharded on the vocab dim (call under ``loss_parallel()`` then).
    """

    def __init__(self) -> None:
        self.global_tokens: float = 1.0

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return token_loss_sum(logits, labels) / self.global_tokens
