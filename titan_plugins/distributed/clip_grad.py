"""Gradient-norm clipping with the norm computed over every mesh.

``torch.nn.utils.clip_grad_norm_`` cannot mix DTensors of different meshes (dense
parameters on the FSDP/TP mesh, experts on the EP mesh) and knows nothing of
pipeline stages. Here gradients are grouped by mesh, each group's norm is reduced
to a full (replicated) value, the groups are combined, and under PP the partial
norms of the stages are all-reduced over the ``pp`` group.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist

__all__ = ["clip_grad_norm_", "total_grad_norm"]


@torch.no_grad()
def total_grad_norm(
    parameters: Iterable[torch.Tensor], norm_type: float = 2.0, pp_group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """The norm of all gradients, as a plain scalar tensor equal on every rank."""
    from torch.distributed.tensor import DTensor

    groups: dict[object, list[torch.Tensor]] = {}
    for p in parameters:
        if p.grad is None:
            continue
        key = p.grad.device_mesh if isinstance(p.grad, DTensor) else None
        groups.setdefault(key, []).append(p.grad)
    norms = []
    for grads in groups.values():
        norm = torch.nn.utils.get_total_norm(grads, norm_type, error_if_nonfinite=False, foreach=None)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        norms.append(norm.float())
    if not norms:
        total = torch.zeros((), dtype=torch.float32)
    elif math.isinf(norm_type):
        total = torch.stack(norms).max()
    else:
        total = torch.stack(norms).pow(norm_type).sum().pow(1.0 / norm_type)
    if pp_group is not None:
        if math.isinf(norm_type):
            dist.all_reduce(total, op=dist.ReduceOp.MAX, group=pp_group)
        else:
            total = total.pow(norm_type)
            dist.all_reduce(total, op=dist.ReduceOp.SUM, group=pp_group)
            total = total.pow(1.0 / norm_type)
    return total


@torch.no_grad()
def clip_grad_norm_(
    parameters: Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    pp_group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Clip in place to ``max_norm`` (no clipping when ``max_norm <= 0``); returns the
    total norm before clipping."""
    from torch.distributed.tensor import DTensor

    params = [p for p in parameters if p.grad is not None]
    total = total_grad_norm(params, norm_type, pp_group)
    if max_norm and max_norm > 0:
        # torch's clip_grads_with_norm_ arithmetic, applied to the local shards: the
        # same scalar multiplies every element, so the result is the same, and no
        # DTensor foreach op has to find a sharding for a list of ~100 placements
        # (seconds of CPU per rank on the first step of an 8-rank TP x EP run).
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        by_device: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for p in params:
            grad = p.grad._local_tensor if isinstance(p.grad, DTensor) else p.grad
            by_device.setdefault((grad.device, grad.dtype), []).append(grad)
        for (device, _), grads in by_device.items():
            torch._foreach_mul_(grads, coef.to(device))
    return total
