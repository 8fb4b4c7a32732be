"""Compute in a ``compute_dtype`` while parameters keep their own dtype.

``None`` always means "no cast". Routing scores are computed in float32 regardless.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def cast(x: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """``x`` in ``dtype`` (no-op for None or when it already is)."""
    return x if dtype is None or x.dtype == dtype else x.to(dtype)


def linear(x: torch.Tensor, module: nn.Linear, dtype: torch.dtype | None) -> torch.Tensor:
    """``module(x)`` computed in ``dtype``.

    Without a cast to make, this calls the module, so forward hooks (e.g. a
    ``parallelize_module`` plan on it) run. With one, it is
    ``F.linear(x.to(dtype), w.to(dtype), b.to(dtype))`` on the module's parameters,
    which bypasses module hooks: under tensor parallelism hand it DTensor inputs.
    """
    if dtype is None or module.weight.dtype == dtype:
        return module(cast(x, dtype))
    bias = None if module.bias is None else cast(module.bias, dtype)
    return F.linear(cast(x, dtype), cast(module.weight, dtype), bias)
