"""Which part of a full tensor this rank holds: the local tensor of a DTensor (or the
tensor itself) and that shard's index into the full tensor. Loaders (Hugging Face
folders, PEFT adapters) read or copy only that slice."""

from __future__ import annotations

import torch

__all__ = ["local_slices"]


def local_slices(value: torch.Tensor) -> tuple[torch.Tensor, tuple[slice, ...]]:
    """``(local tensor to fill, global index of that shard)``."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if isinstance(value, DTensor):
        shape, offset = compute_local_shape_and_global_offset(value.shape, value.device_mesh, value.placements)
        local = value.to_local()
        return local, tuple(slice(o, o + s) for o, s in zip(offset, shape, strict=True))
    return value, tuple(slice(0, s) for s in value.shape)
