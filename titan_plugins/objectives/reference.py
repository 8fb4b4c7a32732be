"""The reference model of objectives that need one (DPO): the policy's forward as it
was before training, under ``torch.no_grad``.

- ``peft=lora``: the same model with its adapters off (every adapter's scaling 0 for
  the forward: ``out + 0``, bitwise the base), so no second copy of the weights.
- Full fine-tuning: a frozen copy built and sharded exactly like the policy (the same
  lifecycle, so FSDP/TP place it the same way) holding the policy's starting weights.

MoE token counters the forward adds to are put back, and FSDP units resharded after
(validation.py's helpers), so a reference pass changes nothing the policy's step reads.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from titan_plugins.peft.lora import adapter_modules, lora_enabled

if TYPE_CHECKING:
    from titan_plugins.train.lifecycle import ModelParts

__all__ = ["Reference", "adapters_off", "build_reference"]


@contextlib.contextmanager
def adapters_off(parts: list[nn.Module]) -> Iterator[int]:
    """Every LoRA adapter of ``parts`` contributes nothing inside the block; yields how
    many were switched off."""
    saved = [(m, m.scaling) for part in parts for _, m in adapter_modules(part)]
    try:
        for m, _ in saved:
            m.scaling = 0.0
        yield len(saved)
    finally:
        for m, scaling in saved:
            m.scaling = scaling


class Reference:
    """``reference(inputs) -> output`` of the reference policy (no grad)."""

    def __init__(self, policy: ModelParts, frozen: ModelParts | None) -> None:
        self.policy, self.frozen = policy, frozen
        self.kind = "the base model (LoRA adapters off, no second copy)" if frozen is None else \
            "a frozen copy of the starting weights, sharded like the policy"

    @torch.no_grad()
    def __call__(self, inputs: torch.Tensor, reduce: Callable[[Any], Any] = lambda out: out) -> Any:
        """``reduce(output)`` of the reference's forward, computed inside the forward's
        contexts: the output may be the last hidden state with a reference to the head
        (train/loss.py computes logits chunk by chunk), so the head's weights must still
        be gathered (FSDP) and the adapters still off when the loss reads it."""
        from titan_plugins.train.validation import moe_counters_kept, resharded

        if self.frozen is not None:
            with resharded(self.frozen.parts):
                return reduce(self.frozen.parts[0](inputs))
        parts = self.policy.parts
        with adapters_off(parts), moe_counters_kept(parts), resharded(parts):
            return reduce(parts[0](inputs))


def build_reference(trainer: Any) -> Reference:
    """The reference of ``trainer``'s policy: call after the policy's weights are loaded."""
    if lora_enabled(trainer.job):
        return Reference(trainer.model, None)
    from titan_plugins.train.lifecycle import build_model_parts

    frozen = build_model_parts(trainer.spec, trainer.job, trainer.dims, trainer.device, trainer.pm, None)
    with torch.no_grad():
        for ref_part, part in zip(frozen.parts, trainer.model.parts, strict=True):
            mine = dict(part.named_parameters())
            for name, param in ref_part.named_parameters():
                param.copy_(mine[name].detach())  # DTensor to DTensor: same placements
                param.requires_grad_(False)
    return Reference(trainer.model, frozen)
