"""What the parallelize hook did to one rank's parts, read from the modules.

Nothing here is configured twice: FSDP units, their meshes, mixed precision and
reshard policy come from FSDP2's own state on each module; tensor/expert-parallel
shapes from each parameter's DTensor placements.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard

__all__ = [
    "DP_MESH_DIMS",
    "FsdpUnit",
    "dtype_name",
    "fsdp_units",
    "local_numel",
    "mesh_label",
    "model_parallel_shape",
]

# Mesh dims that shard or replicate over data parallelism (FSDP, HSDP, expert FSDP).
DP_MESH_DIMS = frozenset({"dp", "dp_replicate", "dp_shard", "dp_shard_mod_ep", "dp_shard_in_ep",
                          "expert_fsdp", "fsdp", "cp", "dp_shard_cp", "dp_cp"})


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def local_numel(p: torch.Tensor) -> int:
    """Elements this rank holds (a DTensor's local shard; never allocates)."""
    return (p._local_tensor if isinstance(p, DTensor) else p).numel()


def model_parallel_shape(p: torch.Tensor) -> tuple[int, ...]:
    """The shape one rank computes with: sharded by TP/EP/ETP, but not by FSDP
    (FSDP all-gathers before compute)."""
    shape = list(p.shape)
    if not isinstance(p, DTensor):
        return tuple(shape)
    mesh = p.device_mesh
    names = mesh.mesh_dim_names or ()
    for i, placement in enumerate(p.placements):
        name = names[i] if i < len(names) else ""
        if isinstance(placement, Shard) and name not in DP_MESH_DIMS:
            shape[placement.dim] = math.ceil(shape[placement.dim] / mesh.size(i))
    return tuple(shape)


def mesh_label(mesh) -> str:
    names = mesh.mesh_dim_names or ("?",)
    return ",".join(names)


@dataclass
class FsdpUnit:
    """One ``fully_shard`` parameter group (one all-gather / reduce-scatter each)."""

    name: str
    mesh: str  # e.g. "dp_shard", "expert_fsdp", "dp_replicate,dp_shard"
    shard_size: int
    replicate_size: int
    unsharded_numel: int  # what the all-gather produces (this rank's TP/EP-local view)
    gathered_numel: int  # all-gather buffer incl. padding = padded shard x shard_size
    padded_shard_numel: int  # what this rank stores, padding included
    param_dtype: torch.dtype
    reduce_dtype: torch.dtype
    reshard_after_forward: bool
    padded_numel: dict[int, int]  # id(parameter) -> padded local shard elements


def fsdp_units(part: nn.Module, weight_dtype: torch.dtype) -> list[FsdpUnit]:
    """Every FSDP2 parameter group of ``part``, in module order."""
    from torch.distributed.fsdp import FSDPModule

    names = {id(m): n for n, m in part.named_modules()}
    units = []
    for module in part.modules():
        if not isinstance(module, FSDPModule):
            continue
        group = module._get_fsdp_state()._fsdp_param_group
        if group is None or not group.fsdp_params:
            continue
        info = group.mesh_info
        shard = int(info.shard_mesh_size)
        replicate = int(getattr(info, "replicate_mesh_size", 1) or 1)
        params = group.fsdp_params
        policy = group.mp_policy  # FSDPParam's own dtype fields exist only after lazy init
        param_dtype = policy.param_dtype or weight_dtype
        units.append(FsdpUnit(
            name=names.get(id(module), "") or "<root>",
            mesh=mesh_label(info.mesh),
            shard_size=shard,
            replicate_size=replicate,
            unsharded_numel=sum(math.prod(fp._orig_size) for fp in params),
            gathered_numel=sum(math.prod(fp.padded_sharded_param_size) * shard for fp in params),
            padded_shard_numel=sum(math.prod(fp.padded_sharded_param_size) for fp in params),
            param_dtype=param_dtype,
            reduce_dtype=policy.reduce_dtype or param_dtype,
            reshard_after_forward=group.post_forward_mesh_info is not None,
            padded_numel={id(fp.sharded_param): math.prod(fp.padded_sharded_param_size) for fp in params},
        ))
    return units
