"""Compute in a ``compute_dtype`` while parameters keep their own dtype.

``None`` always means "no cast". Routing scores are computed in float32 regardless.

``precision.param_dtype`` is applied by FSDP's MixedPrecisionPolicy; a run without
any parallelism has no FSDP, so there it becomes the compute dtype instead
(:func:`unsharded_compute_dtype`), as TorchTitan's trainer autocasts on one device.
Measured on a 2-core AVX-512 BF16 CPU (qwen3 debugmodel, batch 2 x 256, a training
step with fused AdamW, three interleaved rounds): bf16 compute 599-717 tokens/s,
``torch.autocast`` 604-730, fp32 401-529; the two bf16 paths are level here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from titan_plugins.distributed.parallel_dims import ParallelDims


def cast(x: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """``x`` in ``dtype`` (no-op for None or when it already is)."""
    return x if dtype is None or x.dtype == dtype else x.to(dtype)


def linear(x: torch.Tensor, module: nn.Linear, dtype: torch.dtype | None) -> torch.Tensor:
    """``module(x)`` computed in ``dtype``.

    Without a cast to make, this calls the module, so forward hooks (e.g. a
    ``parallelize_module`` plan on it) run. With one, it is
    ``F.linear(x.to(dtype), w.to(dtype), b.to(dtype))`` on the module's parameters,
    which bypasses module hooks: under tensor parallelism hand it DTensor inputs. A module
    with ``computes_in_input_dtype`` (LoRA's, titan_plugins/peft) casts its own weights to
    its input's dtype: it is called.
    """
    if dtype is None or module.weight.dtype == dtype or getattr(module, "computes_in_input_dtype", False):
        return module(cast(x, dtype))
    bias = None if module.bias is None else cast(module.bias, dtype)
    return F.linear(cast(x, dtype), cast(module.weight, dtype), bias)


class ComputeDtypeMixin:
    """``set_compute_dtype`` for a model whose modules read a ``compute_dtype`` attribute
    (the projections, norms, attention, FFN, experts and output each cast to it).

    Mix in before ``nn.Module``: ``class MyModel(ComputeDtypeMixin, nn.Module)``.
    """

    compute_dtype: torch.dtype | None = None

    def set_compute_dtype(self, dtype: torch.dtype | None) -> None:
        """Compute in ``dtype`` (``None``: the parameters' dtype); parameters and
        buffers keep their own dtype. Sets every module that has the attribute."""
        for module in self.modules():  # type: ignore[attr-defined]  # an nn.Module
            if hasattr(module, "compute_dtype"):
                module.compute_dtype = dtype


def unsharded_compute_dtype(precision: DictConfig, parallel_dims: ParallelDims) -> torch.dtype | None:
    """The compute dtype implied by ``precision.param_dtype`` when nothing shards or
    splits the model (no FSDP/HSDP, TP, PP or EP), else None.

    With FSDP the policy casts the parameters; under TP/PP without FSDP the run stays
    in ``weight_dtype``, as TorchTitan does (its autocast is single-device only).
    An explicit ``precision.compute_dtype`` wins, so this returns None then.
    """
    from titan_plugins.distributed.fsdp import to_torch_dtype

    if getattr(precision, "compute_dtype", None) is not None:
        return None
    degrees = ("dp_shard", "dp_replicate", "cp", "tp", "pp", "ep")
    if any(int(getattr(parallel_dims, name, 1)) > 1 for name in degrees):
        return None
    param = to_torch_dtype(precision.param_dtype)
    return None if param == to_torch_dtype(precision.weight_dtype) else param
