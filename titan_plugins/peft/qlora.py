"""QLoRA (``peft=qlora``): LoRA over a frozen base whose adapted linears hold their
weight in 4-bit NF4 (torchao's ``NF4Tensor``), with the blocks' scales quantized
again to int8 (double quantization), as the QLoRA paper and torchtune do.

The adapted modules are LoRA's (``apply_lora``): same adapters, names, init,
checkpoints and PEFT export. What changes is the base ``weight``: on meta it stops
being a parameter and becomes a persistent buffer of the same name (so the state-dict
key, ``model.hf`` loading and ``init_weights`` still find it, and neither FSDP nor a TP
plan shards or trains it). :func:`quantize_base` replaces it by its NF4 form once it
holds values; later writes (``model.hf``, ``checkpoint.init_from``) go through
``NF4Tensor.copy_``, which quantizes each tensor as it is read.

Compute: ``x W^T`` with ``W`` dequantized to the activations' dtype (the run's
precision) in the forward and again in the backward (``torchao``'s ``linear_nf4``);
only the 4-bit weight is kept. Under FSDP and TP the 4-bit base is *replicated* on
every rank (adapters and every other parameter shard as usual): a TP rank computes its
QLoRA linears whole, from the gathered input, and hands the layout its plan expects.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from titan_plugins.errors import ConfigError
from titan_plugins.peft.lora import LoRALinear, adapter_modules, apply_lora

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from titan_plugins.peft.config import PeftConfig

__all__ = ["QLoRALinear", "apply_qlora", "check_qlora", "dequantized", "qlora_enabled", "quantize_base",
           "round_trip_base"]

BLOCK_SIZE = 64  # weights per NF4 scale (QLoRA's and torchtune's)
SCALER_BLOCK_SIZE = 256  # scales per int8 second-level scale (double quantization)


def qlora_enabled(job: DictConfig) -> bool:
    peft = job.get("peft") if hasattr(job, "get") else getattr(job, "peft", None)
    return peft is not None and str(getattr(peft.method, "value", peft.method)) == "qlora"


def _nf4():
    import logging

    # torchao's import warns about CUDA kernels a CPU build cannot load and torch about its
    # enums: noise on every rank, not for the user
    logging.getLogger("torchao").setLevel(logging.ERROR)
    pytree = logging.getLogger("torch.utils._pytree")
    level = pytree.level
    pytree.setLevel(logging.ERROR)
    try:
        from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import (
            NF4Tensor,
            linear_nf4,
            to_nf4,
        )
    except ImportError as exc:  # the optional extra
        raise ConfigError("peft.method=qlora needs torchao (pip install 'titan-plugins[qlora]')") from exc
    finally:
        pytree.setLevel(level)
    return NF4Tensor, linear_nf4, to_nf4


def _is_nf4(t: object) -> bool:
    return type(t).__name__ == "NF4Tensor"


class QLoRALinear(LoRALinear):
    """A ``LoRALinear`` whose frozen ``weight`` is a buffer, NF4 once quantized."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = _base(x, self.weight, self.bias)
        h = self.lora_dropout(x)
        a, b = self.lora_A.weight, self.lora_B.weight
        delta = F.linear(F.linear(h, a.to(h.dtype)), b.to(h.dtype))
        return out + delta * self.scaling


def _base(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x W^T (+ b)`` in ``x``'s dtype; a DTensor input (a TP plan's) is gathered, the
    output handed back ``Replicate`` for the plan's output hook to lay out."""
    from torch.distributed.tensor import DTensor, Replicate

    mesh = None
    if isinstance(x, DTensor):
        mesh, x = x.device_mesh, x.full_tensor()
    if _is_nf4(weight):
        out = _nf4()[1](x, weight)
    else:  # not quantized yet (a meta or freshly built model)
        out = F.linear(x, weight.to(x.dtype))
    if bias is not None:
        out = out + (bias.full_tensor() if isinstance(bias, DTensor) else bias).to(out.dtype)
    if mesh is not None:
        out = DTensor.from_local(out, mesh, [Replicate()] * mesh.ndim, run_check=False)
    return out


def check_qlora(job: DictConfig) -> None:
    """What QLoRA cannot serve, in one line, before any rank starts."""
    par = job.parallelism
    for key in ("pp", "ep"):
        if int(par.get(key, 1)) > 1:
            raise ConfigError(
                f"peft.method=qlora: not with parallelism.{key}={par[key]} (the 4-bit base is served "
                "under FSDP and TP only); use peft=lora or drop the pipeline/expert parallelism"
            )


def apply_qlora(model: nn.Module, peft: PeftConfig, exclude: tuple[str, ...] = ()) -> list[str]:
    """``apply_lora``, then each adapted module's ``weight`` becomes a frozen buffer
    (works on meta); quantized later by :func:`quantize_base`."""
    names = apply_lora(model, peft, exclude)
    for name in names:
        module = model.get_submodule(name)
        if module.weight.numel() % BLOCK_SIZE:
            raise ConfigError(
                f"peft.method=qlora: {name}.weight has {module.weight.numel()} elements, not a multiple "
                f"of the NF4 block of {BLOCK_SIZE}; leave the module out of peft.target_modules"
            )
        weight = module._parameters.pop("weight")
        module.register_buffer("weight", weight.detach(), persistent=True)
        module.__class__ = QLoRALinear
    return names


def _scaler_block(n_scales: int) -> int:
    """The largest block of at most SCALER_BLOCK_SIZE scales that divides them (a
    tiny matrix has fewer scales than one block)."""
    return max(d for d in range(1, min(SCALER_BLOCK_SIZE, n_scales) + 1) if n_scales % d == 0)


@torch.no_grad()
def quantize_base(model: nn.Module) -> int:
    """Every QLoRA module's base weight to NF4 (double-quantized scales), in place,
    one tensor at a time; returns how many."""
    from torch.distributed.tensor import DTensor

    to_nf4 = _nf4()[2]
    count = 0
    for _, module in adapter_modules(model):
        if isinstance(module, QLoRALinear) and not _is_nf4(module.weight):
            w = module.weight
            if isinstance(w, DTensor):  # a TP style replicates the buffers it does not shard
                assert all(p.is_replicate() for p in w.placements), w.placements
                w = w.to_local()
            module._buffers["weight"] = to_nf4(w, BLOCK_SIZE, _scaler_block(w.numel() // BLOCK_SIZE))
            del w
            count += 1
    return count


def dequantized(value: torch.Tensor) -> torch.Tensor:
    """A base weight as a plain tensor in its original dtype (NF4 dequantized)."""
    return value.get_original_weight() if _is_nf4(value) else value


@torch.no_grad()
def round_trip_base(state_dict: dict[str, torch.Tensor], adapters: dict[str, torch.Tensor],
                    dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """A full-precision base (``model.hf``, a checkpoint) as the QLoRA run saw it: each
    adapted module's weight cast to the run's weight ``dtype`` (the run quantized what it
    loaded into its own dtype), quantized to NF4 and back, with the run's blocks. Then
    ``merge_into`` gives what a live QLoRA model merges (``--merge`` of a QLoRA run)."""
    to_nf4 = _nf4()[2]
    out = dict(state_dict)
    for key in adapters:
        if key.endswith(".lora_A.weight"):
            name = key[: -len(".lora_A.weight")] + ".weight"
            w = out[name] if dtype is None else out[name].to(dtype)
            out[name] = to_nf4(w, BLOCK_SIZE, _scaler_block(w.numel() // BLOCK_SIZE)).get_original_weight()
    return out
