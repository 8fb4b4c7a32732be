"""AdamW with weight-decay groups, and warmup + linear/cosine decay schedules.

One optimizer and one scheduler per model part (pipeline stages hold several),
stepped together, so DCP's per-module optimizer state dicts apply.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

__all__ = [
    "build_lr_scheduler", "build_optimizer", "implementation", "lr_lambda", "param_groups", "resync_lr",
]


def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Matrices (and embeddings) decay; vectors (norm weights, biases) do not."""
    decay, no_decay = [], []
    for p in model.parameters():
        if not p.requires_grad:
            continue
        (decay if p.ndim >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


# Devices with a fused AdamW kernel in torch (one vectorized pass per tensor instead
# of ~10 elementwise ops; measured 2-4x faster than the for-loop default on CPU).
_FUSED_DEVICES = {"cpu", "cuda"}


def implementation(groups: list[dict[str, Any]]) -> dict[str, bool]:
    """``{"fused": True}`` when every parameter lives on a device with the fused
    kernel (DTensor parameters report their local device), else torch's default.

    Not bit-equal to the for-loop (the fused kernel rounds its update in one
    expression), but deterministic: repeat runs and resumes stay bit for bit.
    """
    devices = {p.device.type for g in groups for p in g["params"]}
    floating = all(p.is_floating_point() for g in groups for p in g["params"])
    return {"fused": True} if devices and devices <= _FUSED_DEVICES and floating else {}


def build_optimizer(model: nn.Module, training: Any) -> torch.optim.Optimizer:
    groups = param_groups(model, float(training.weight_decay))
    return torch.optim.AdamW(
        groups,
        lr=float(training.lr),
        betas=(float(training.beta1), float(training.beta2)),
        eps=float(training.eps),
        weight_decay=float(training.weight_decay),
        **implementation(groups),
    )


def lr_lambda(step: int, training: Any) -> float:
    """Multiplier of ``training.lr`` for optimizer step ``step`` (0-based): linear
    warmup from ``1/(warmup+1)``, then decay to ``min_lr_ratio`` at the last step."""
    warmup, total = int(training.warmup_steps), int(training.steps)
    if step < warmup:
        return (step + 1) / (warmup + 1)
    decay = str(getattr(training.decay, "value", training.decay))
    if decay == "none":
        return 1.0
    span = max(1, total - warmup)
    progress = min(1.0, (step - warmup) / span)
    floor = float(training.min_lr_ratio)
    if decay == "linear":
        return floor + (1.0 - floor) * (1.0 - progress)
    if decay == "cosine":
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"training.decay={decay!r} is not one of none, linear, cosine")


def build_lr_scheduler(optimizer: torch.optim.Optimizer, training: Any):
    import functools

    return torch.optim.lr_scheduler.LambdaLR(optimizer, functools.partial(lr_lambda, training=_Plain(training)))


def resync_lr(scheduler: torch.optim.lr_scheduler.LambdaLR) -> None:
    """After a resume, set every group's lr from *this* run's schedule at the resumed step.

    A loaded optimizer state carries the lr the saved run computed for its next step;
    when ``training.steps`` (or warmup/decay) changed, that value belongs to the old
    schedule and the first resumed step would use it: the lr would jump for one step.
    """
    step = scheduler.last_epoch
    lrs = [base * fn(step) for base, fn in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
    for group, lr in zip(scheduler.optimizer.param_groups, lrs):
        group["lr"] = lr
    scheduler._last_lr = lrs


class _Plain:
    """A picklable snapshot of the schedule settings (no OmegaConf node inside)."""

    def __init__(self, training: Any) -> None:
        for key in ("warmup_steps", "steps", "decay", "min_lr_ratio"):
            value = getattr(training, key)
            setattr(self, key, getattr(value, "value", value))
