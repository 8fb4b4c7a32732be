"""``Batch``: what every loader hands the trainer (its own module so that both loaders
import it and neither imports the other)."""

from __future__ import annotations

from typing import Any

import torch


class Batch(tuple):
    """``(input_ids, labels)`` that unpacks as a pair and may carry ``doc_ids``
    (``[batch, seq_len]`` document index per token, for packed conversations; None
    where documents are found from the tokens, as in pre-training) and ``rows`` (what a
    source hands over per row besides tokens: ``data.name=prompts``' prompt rows, which
    an online objective's rollout reads; None elsewhere)."""

    doc_ids: torch.Tensor | None
    rows: list[Any] | None = None

    def __new__(cls, inputs: torch.Tensor, labels: torch.Tensor,
                doc_ids: torch.Tensor | None = None) -> Batch:
        batch = super().__new__(cls, (inputs, labels))
        batch.doc_ids = doc_ids
        return batch

    def __reduce__(self) -> Any:
        return (Batch, (self[0], self[1], self.doc_ids))
