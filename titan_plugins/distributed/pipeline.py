"""Pipeline parallelism on ``torch.distributed.pipelining``: split, stages, schedule.

The split works on the meta model by module names (``PipelineInfo``): each local
stage is a deep copy that keeps a contiguous range of blocks and sets the modules
it does not own (``tok_embeddings`` / ``norm`` / ``output``) to ``None``. Blocks
are spread evenly over ``pp * pp_stages_per_rank`` virtual stages; rank ``r``
holds stages ``r, r + pp, r + 2 pp, ...`` (the looped layout Interleaved1F1B uses).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from titan_plugins.errors import ConfigError
from titan_plugins.spec import PipelineInfo

__all__ = [
    "SCHEDULES",
    "build_schedule",
    "build_stages",
    "layer_ranges",
    "num_microbatches",
    "split_model",
    "stage_ids",
]

SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B")
_MULTI_STAGE = ("Interleaved1F1B",)


def _value(x: Any) -> str:
    return str(getattr(x, "value", x))


def num_virtual_stages(parallelism: Any) -> int:
    return int(parallelism.pp) * int(parallelism.pp_stages_per_rank)


def num_microbatches(parallelism: Any) -> int:
    return int(parallelism.pp_microbatches or num_virtual_stages(parallelism))


def layer_ranges(n_layers: int, num_stages: int) -> list[tuple[int, int]]:
    """``[start, end)`` block ranges, as even as possible (earlier stages get the extra)."""
    if n_layers < num_stages:
        raise ConfigError(
            f"the model has {n_layers} layers, fewer than the {num_stages} pipeline stages "
            "(parallelism.pp x parallelism.pp_stages_per_rank)"
        )
    base, extra = divmod(n_layers, num_stages)
    ranges, start = [], 0
    for s in range(num_stages):
        end = start + base + (1 if s < extra else 0)
        ranges.append((start, end))
        start = end
    return ranges


def stage_ids(pp_rank: int, pp: int, stages_per_rank: int) -> list[int]:
    return [pp_rank + i * pp for i in range(stages_per_rank)]


def validate_pipeline(parallelism: Any, local_batch_size: int, n_layers: int | None = None) -> None:
    """Every pipeline setting a user can get wrong, checked before ranks start."""
    if int(parallelism.pp) <= 1:
        return
    schedule = _value(parallelism.pp_schedule)
    if schedule not in SCHEDULES:
        raise ConfigError(f"parallelism.pp_schedule={schedule} is not one of {', '.join(SCHEDULES)}")
    per_rank = int(parallelism.pp_stages_per_rank)
    if per_rank < 1:
        raise ConfigError(f"parallelism.pp_stages_per_rank={per_rank} must be at least 1")
    if per_rank > 1 and schedule not in _MULTI_STAGE:
        raise ConfigError(
            f"parallelism.pp_stages_per_rank={per_rank} needs a multi-stage schedule "
            f"(Interleaved1F1B), not parallelism.pp_schedule={schedule}"
        )
    if n_layers is not None:  # the model's shape first: no batch setting can fix it
        layer_ranges(n_layers, num_virtual_stages(parallelism))
    micro = num_microbatches(parallelism)
    if local_batch_size % micro:
        default = " (by default one per pipeline stage)" if parallelism.pp_microbatches is None else ""
        raise ConfigError(
            f"training.local_batch_size={local_batch_size} is not divisible by "
            f"parallelism.pp_microbatches={micro}{default}: raise the batch or set the microbatches"
        )
    if schedule in _MULTI_STAGE and micro % int(parallelism.pp):
        raise ConfigError(
            f"parallelism.pp_microbatches={micro} must be a multiple of parallelism.pp={parallelism.pp} "
            f"for {schedule}"
        )



def split_model(
    model: nn.Module, info: PipelineInfo, pp_rank: int, parallelism: Any
) -> list[tuple[int, nn.Module]]:
    """This pp rank's ``(stage_index, module)`` parts of the (meta) ``model``."""
    num_stages = num_virtual_stages(parallelism)
    layers = getattr(model, info.layers_attr)
    ranges = layer_ranges(len(layers), num_stages)
    parts = []
    for stage in stage_ids(pp_rank, int(parallelism.pp), int(parallelism.pp_stages_per_rank)):
        part = copy.deepcopy(model)
        start, end = ranges[stage]
        part_layers = getattr(part, info.layers_attr)
        for key in list(part_layers.keys()):
            if not start <= int(key) < end:
                del part_layers[key]
        if stage != 0:
            for name in info.first_stage_modules:
                setattr(part, name, None)
        if stage != num_stages - 1:
            for name in info.last_stage_modules:
                setattr(part, name, None)
        parts.append((stage, part))
    return parts


def stage_inputs(part: nn.Module, info: Any, tokens: torch.Tensor) -> dict[str, Any]:
    """The keyword inputs every stage's forward gets for this batch: the model method
    ``PipelineInfo.stage_inputs`` names, called on the token ids; ``{}`` if none."""
    name = info.stage_inputs if info is not None else None
    return getattr(part, name)(tokens) if name else {}


def _side_effect_free_stage_class() -> type:
    """A ``PipelineStage`` whose metadata inference leaves module buffers untouched.

    On its first step, torch's stage infers shapes by running a real forward (real
    tokens on the first stage, uninitialised tensors on later ones). Buffers that a
    forward updates, such as MoE ``tokens_per_expert``, would count that pass too and
    skew load balancing under PP only; so buffers are restored after inference.
    """
    from torch.distributed.pipelining import PipelineStage

    class SideEffectFreeStage(PipelineStage):
        def _forward_metadata_inference(self, *args: Any, **kwargs: Any) -> Any:
            saved = [(buf, buf.detach().clone()) for buf in self.submod.buffers()]
            try:
                return super()._forward_metadata_inference(*args, **kwargs)
            finally:
                # Only buffers the pass changed: an untouched one (freqs_cis) may be
                # saved for the backward inference that follows, so keep its version.
                with torch.no_grad():
                    for buf, value in saved:
                        if not torch.equal(buf, value):
                            buf.copy_(value)

    return SideEffectFreeStage


def build_stages(
    parts: list[tuple[int, nn.Module]], num_stages: int, device: torch.device, pp_group: Any
) -> list[Any]:
    stage_cls = _side_effect_free_stage_class()
    return [
        stage_cls(module, stage_index, num_stages, device, group=pp_group)
        for stage_index, module in parts
    ]


def build_schedule(stages: list[Any], parallelism: Any, loss_fn: Callable | None) -> Any:
    """The schedule ``parallelism.pp_schedule`` names with ``pp_microbatches``; gradients
    are not scaled by the schedule (the loss already divides by the global token count)."""
    from torch.distributed.pipelining import (
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
    )

    name = _value(parallelism.pp_schedule)
    cls = {"GPipe": ScheduleGPipe, "1F1B": Schedule1F1B, "Interleaved1F1B": ScheduleInterleaved1F1B}[name]
    micro = num_microbatches(parallelism)
    target = stages if name in _MULTI_STAGE else stages[0]
    return cls(target, n_microbatches=micro, loss_fn=loss_fn, scale_grads=False)
