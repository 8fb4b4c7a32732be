"""Per-rank bytes of parameters, gradients, optimizer state, buffers and the
FSDP all-gather buffers, by dtype, from the parts' local shard shapes.

Dtypes follow the runtime: parameters are cast to ``precision.weight_dtype``
after ``to_empty`` (when it is not float32), gradients live in the parameter's
dtype, AdamW keeps ``exp_avg`` and ``exp_avg_sq`` like the parameter plus a
float32 ``step`` per tensor. FSDP-sharded parameters are stored padded to equal
shards (``padded`` bytes are what a rank allocates; ``numel`` is the unpadded
shard, what the rank's ``state_dict`` holds).

Transient FSDP memory (unsharded parameters in ``param_dtype``, unsharded
gradients in ``reduce_dtype``): with resharding after forward, the largest unit
twice (the one computing and the one prefetched) plus its gradient; without it
(the PP default) every unit of the stage stays gathered between forward and
backward.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch
from torch import nn

from titan_plugins.plan.sharding import FsdpUnit, dtype_name, local_numel

__all__ = ["MemoryBreakdown", "fsdp_transient_bytes", "state_memory"]


@dataclass
class MemoryBreakdown:
    numel: int = 0  # parameter elements on this rank (unpadded local shards)
    tensors: int = 0
    parameters: dict[str, int] = field(default_factory=dict)  # dtype -> bytes (padded)
    gradients: dict[str, int] = field(default_factory=dict)
    optimizer: dict[str, int] = field(default_factory=dict)
    buffers: dict[str, int] = field(default_factory=dict)

    def total(self, key: str) -> int:
        return sum(getattr(self, key).values())


def _storage_dtype(t: torch.Tensor, weight_dtype: torch.dtype) -> torch.dtype:
    # Module.to(dtype) casts floating tensors only (not ints, not complex).
    if weight_dtype != torch.float32 and t.is_floating_point():
        return weight_dtype
    return t.dtype


def state_memory(parts: list[nn.Module], units: list[FsdpUnit], weight_dtype: torch.dtype) -> MemoryBreakdown:
    padded: dict[int, int] = {}
    for unit in units:
        padded.update(unit.padded_numel)
    out = MemoryBreakdown()
    params_b: dict[str, int] = defaultdict(int)
    grads_b: dict[str, int] = defaultdict(int)
    optim_b: dict[str, int] = defaultdict(int)
    buffers_b: dict[str, int] = defaultdict(int)
    for part in parts:
        for p in part.parameters():
            dtype = _storage_dtype(p, weight_dtype)
            size = dtype.itemsize
            n = local_numel(p)
            stored = padded.get(id(p), n)
            out.numel += n
            out.tensors += 1
            params_b[dtype_name(dtype)] += stored * size
            if p.requires_grad:
                grads_b[dtype_name(dtype)] += n * size
                optim_b[dtype_name(dtype)] += 2 * n * size
                optim_b["float32"] += 4  # AdamW's step
        for b in part.buffers():
            dtype = _storage_dtype(b, weight_dtype)
            buffers_b[dtype_name(dtype)] += local_numel(b) * dtype.itemsize
    out.parameters, out.gradients = dict(params_b), dict(grads_b)
    out.optimizer, out.buffers = dict(optim_b), dict(buffers_b)
    return out


def fsdp_transient_bytes(units: list[FsdpUnit]) -> dict[str, int]:
    """Bytes of unsharded parameters and gradients alive at the worst moment."""
    if not units:
        return {}
    out: dict[str, int] = defaultdict(int)
    kept = [u for u in units if not u.reshard_after_forward]
    resharded = [u for u in units if u.reshard_after_forward]
    for u in kept:
        out[dtype_name(u.param_dtype)] += u.gathered_numel * u.param_dtype.itemsize
    if resharded:
        biggest = sorted(resharded, key=lambda u: u.gathered_numel * u.param_dtype.itemsize)[-2:]
        for u in biggest:
            out[dtype_name(u.param_dtype)] += u.gathered_numel * u.param_dtype.itemsize
    worst_grad = max(units, key=lambda u: u.gathered_numel * u.reduce_dtype.itemsize)
    out[dtype_name(worst_grad.reduce_dtype)] += worst_grad.gathered_numel * worst_grad.reduce_dtype.itemsize
    return dict(out)
