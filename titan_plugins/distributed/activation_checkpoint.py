"""Activation checkpointing per block: ``none``, ``selective`` (every
``training.selective_every``-th block) or ``full`` (every block).

Blocks are wrapped in place inside ``model.<layers_attr>``; the wrapper inserts
``_checkpoint_wrapped_module`` into parameter names, which
``torch.distributed.checkpoint.state_dict`` strips, so checkpoints stay
interchangeable between AC settings.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

if TYPE_CHECKING:
    from omegaconf import DictConfig

__all__ = ["apply_activation_checkpointing", "checkpoint_mode"]


def checkpoint_mode(job_config: DictConfig) -> str:
    mode = job_config.training.activation_checkpoint
    return str(getattr(mode, "value", mode))


def apply_activation_checkpointing(model: nn.Module, job_config: DictConfig, *, layers_attr: str = "layers") -> None:
    """Wrap blocks of ``model.<layers_attr>`` with non-reentrant checkpointing.

    ``selective`` wraps block ``i`` (its global index, so a pipeline stage picks the
    same blocks as the whole model would) when ``(i + 1) % selective_every == 0``.
    """
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        checkpoint_wrapper,
    )

    mode = checkpoint_mode(job_config)
    if mode == "none":
        return
    if mode not in ("selective", "full"):
        raise ValueError(f"training.activation_checkpoint={mode!r} is not one of none, selective, full")
    every = int(job_config.training.selective_every) if mode == "selective" else 1
    if every < 1:
        raise ValueError(f"training.selective_every={every} must be at least 1")
    layers = getattr(model, layers_attr)
    for key, block in list(layers.items()):
        if (int(key) + 1) % every:
            continue
        wrapped = checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT, preserve_rng_state=False)
        layers.register_module(key, wrapped)
