"""QLoRA (``peft=qlora``): LoRA over a frozen base whose adapted linears hold their
weight in 4-bit NF4 (torchao's ``NF4Tensor``), with the blocks' scales quantized
again to int8 (double quantization), as the QLoRA paper and torchtune do.

The adapted modules are LoRA's (``apply_lora``): same adapters, names, init,
checkpoints and PEFT export. What changes is the base ``weight`` (same state-dict key):

- on meta it stops being a trainable parameter: a persistent buffer (replicated on
  every rank: one process, TP, HSDP), or under FSDP alone (:func:`shard_base`) a frozen
  NF4 parameter that ``fully_shard`` shards by rows like any other (torchao's NF4Tensor
  implements FSDP2's all-gather extension);
- the build (:func:`base_aside`) keeps it out of ``to_empty``, ``init_weights`` and the
  dtype cast. When ``model.hf`` or ``checkpoint.init_from`` will give its values it stays
  on meta until the loader reads it (:func:`pending_base`, :func:`load_base_from_dcp`):
  one tensor at a time, cast to ``precision.weight_dtype``, quantized whole, then cut to
  this rank's rows. So the full-precision base never exists on a rank, only one weight
  of it at a time. A random-init base (tests) is built whole as before, then quantized.

Quantizing whole, then cutting, matters: double quantization subtracts the mean of all
the blocks' scales, and FSDP's all-gather rebuilds the weight with one shard's mean;
the shards of one quantized tensor share it, shards quantized alone would not.

Compute: ``x W^T`` with ``W`` dequantized to the activations' dtype (the run's
precision) in the forward and again in the backward (``peft/nf4_linear.py``: the
values of torchao's dequantization by a byte lookup); only the 4-bit weight is kept. Under TP the 4-bit base is replicated: a TP rank
computes its QLoRA linears whole, from the gathered input, and hands the layout its
plan expects (a TP plan would try to distribute an NF4 parameter).
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from titan_plugins.errors import ConfigError
from titan_plugins.peft.lora import LoRALinear, adapter_modules, apply_lora
from titan_plugins.peft.nf4_linear import linear_nf4

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from titan_plugins.peft.config import PeftConfig

__all__ = ["BaseReceiver", "QLoRALinear", "apply_qlora", "base_aside", "check_qlora", "dequantized",
           "install_base", "load_base_from_dcp", "pending_base", "qlora_enabled", "round_trip_base", "shard_base"]

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
    """A ``LoRALinear`` whose frozen ``weight`` is NF4 once it holds values (a buffer,
    or a frozen FSDP parameter); ``base_dtype`` / ``base_device``: what it quantizes from."""

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
        out = linear_nf4(x, weight)
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
    (works on meta); see :func:`shard_base` and :func:`base_aside` for what follows."""
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


def _qlora_modules(model: nn.Module) -> Iterator[tuple[str, QLoRALinear]]:
    for name, module in adapter_modules(model):
        if isinstance(module, QLoRALinear):
            yield name, module


def _scaler_blocks(shape: torch.Size) -> int:
    n_scales = math.prod(shape) // BLOCK_SIZE
    return n_scales // _scaler_block(n_scales)


def _meta_nf4(shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    empty = torch.empty(shape, dtype=dtype, device="meta")
    return _nf4()[2](empty, BLOCK_SIZE, _scaler_block(empty.numel() // BLOCK_SIZE))


def shard_base(model: nn.Module, shards: int) -> int:
    """On meta, before ``fully_shard``: every QLoRA base weight whose NF4 form cuts into
    ``shards`` equal row blocks (whole scale blocks each) becomes a frozen NF4 parameter,
    which FSDP shards; the others stay replicated buffers. Returns how many."""
    count = 0
    for _, module in _qlora_modules(model):
        shape = module.weight.shape
        if shards > 1 and shape[0] % shards == 0 and _scaler_blocks(shape) % shards == 0:
            weight = module._buffers.pop("weight")
            module.register_parameter("weight", nn.Parameter(_meta_nf4(shape, weight.dtype), requires_grad=False))
            count += 1
    return count


class _Aside:
    """The QLoRA base weights of a model while it is materialized (:func:`base_aside`)."""

    def __init__(self, model: nn.Module, device: torch.device, filled_later: bool) -> None:
        self.held = []
        for _, module in _qlora_modules(model):
            slot = module._parameters if "weight" in module._parameters else module._buffers
            placeholder = slot.pop("weight")
            stand_in = torch.empty(placeholder.shape, dtype=placeholder.dtype,
                                   device="meta" if filled_later else device)
            module.__dict__["weight"] = placeholder  # FSDP's _apply looks it up: still the meta one
            self.held.append((module, slot, placeholder, stand_in))

    @contextmanager
    def for_init(self) -> Iterator[None]:
        """Within: each weight reads as a plain tensor of its shape (``init_weights``)."""
        for module, _, _, stand_in in self.held:
            module.__dict__["weight"] = stand_in
        yield
        for module, _, placeholder, _ in self.held:
            module.__dict__["weight"] = placeholder

    def put_back(self, dtype: torch.dtype, device: torch.device, quantize: bool) -> None:
        for module, slot, placeholder, stand_in in self.held:
            del module.__dict__["weight"]
            slot["weight"] = placeholder
            module.base_dtype, module.base_device = dtype, torch.device(device)
            if quantize:
                install_base(module, stand_in.to(dtype))
        self.held.clear()


@contextmanager
def base_aside(model: nn.Module, device: torch.device, dtype: torch.dtype, *, filled_later: bool) -> Iterator[_Aside]:
    """Around ``to_empty``, ``init_weights`` (inside ``aside.for_init()``) and the dtype
    cast: each QLoRA base weight is no parameter or buffer there, so ``to_empty`` and
    ``Module._apply`` skip it (neither can then dequantize or re-type an NF4 placeholder);
    ``init_weights`` finds a plain tensor of its shape. ``filled_later`` (``model.hf``,
    ``checkpoint.init_from``): that tensor is on meta (``nn.init`` does nothing there and
    draws no random numbers) and the weight waits for the loader; else it is
    materialized and initialised, and quantized on the way out (``dtype``: the run's
    weight dtype)."""
    aside = _Aside(model, device, filled_later)
    yield aside
    with torch.no_grad():
        aside.put_back(dtype, device, quantize=not filled_later)


@torch.no_grad()
def install_base(module: QLoRALinear, full: torch.Tensor) -> None:
    """``full`` (the whole weight, in the run's dtype) quantized whole to NF4 and put in
    place: this rank's row block of it under FSDP, all of it otherwise."""
    to_nf4 = _nf4()[2]
    nf4 = to_nf4(full, BLOCK_SIZE, _scaler_block(full.numel() // BLOCK_SIZE))
    if "weight" in module._parameters:
        module._parameters["weight"] = _row_shard(nf4, module._parameters["weight"])
    else:
        module._buffers["weight"] = nf4


def _row_shard(nf4: torch.Tensor, placeholder: torch.Tensor) -> nn.Parameter:
    """This rank's rows of ``nf4`` as the FSDP parameter ``placeholder`` lays them out
    (torchtune's ``load_from_full_model_state_dict``): the chunk shares its scales' mean
    with the whole, and is copied into storage of its own so the whole is freed."""
    from torch.distributed.tensor import DTensor

    mesh = placeholder.device_mesh
    chunk = torch.chunk(nf4, mesh.size(), dim=0)[mesh.get_local_rank()]
    local = chunk.new_zeros(chunk.shape)
    local.copy_(chunk)
    sharded = DTensor.from_local(local, mesh, placeholder.placements, run_check=False,
                                 shape=nf4.shape, stride=nf4.stride())
    return nn.Parameter(sharded, requires_grad=False)


class BaseReceiver:
    """Stands for one QLoRA base weight still on meta in a loader's state dict: takes
    the whole tensor (``copy_``), which :func:`install_base` quantizes and places."""

    def __init__(self, module: QLoRALinear) -> None:
        self.module = module
        self.shape = tuple(module.weight.shape)
        self.dtype, self.device = module.base_dtype, module.base_device

    def numel(self) -> int:
        return math.prod(self.shape)

    def copy_(self, full: torch.Tensor) -> None:
        install_base(self.module, full)


def pending_base(model: nn.Module) -> dict[str, BaseReceiver]:
    """``{state-dict key: receiver}`` of the QLoRA base weights that wait for their
    values (built with ``filled_later``, not loaded yet)."""
    return {f"{name}.weight": BaseReceiver(module)
            for name, module in _qlora_modules(model) if module.weight.is_meta}


def load_base_from_dcp(parts: list[nn.Module], path: str | os.PathLike) -> int:
    """``checkpoint.init_from`` for the pending QLoRA base weights: each read whole from
    the DCP checkpoint on this rank alone (one at a time), then quantized and placed.
    Returns how many."""
    import torch.distributed.checkpoint as dcp

    count = 0
    for part in parts:
        for key, receiver in pending_base(part).items():
            full = torch.empty(receiver.shape, dtype=receiver.dtype, device=receiver.device)
            dcp.load({"model": {key: full}}, checkpoint_id=str(path), no_dist=True)
            receiver.copy_(full)
            del full
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
