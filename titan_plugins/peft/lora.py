"""LoRA as a model transform: ``apply_lora`` turns the matched ``nn.Linear`` modules
of any plugin's model into ``LoRALinear`` in place, between ``build`` (on meta) and
the plugin's ``parallelize`` hook, and freezes everything else.

``LoRALinear`` *is* the original module (its class is swapped, its ``weight`` and
``bias`` stay where they were), so the base keeps its state-dict keys, TP plans and
FSDP units address it by its own name, and ``model.hf`` / ``checkpoint.init_from``
load it unchanged. The adapters are two child modules with PEFT's names and shapes,
``lora_A.weight`` ``[rank, in]`` and ``lora_B.weight`` ``[out, rank]``::

    y = base(x) + (alpha / rank) * B (A dropout(x))

``B`` starts at zero, so step 0 is the base model bit for bit. Grouped MoE experts
named by a pattern get per-expert pairs as grouped tensors (``peft/experts.py``). The
adapters stay fp32 whatever ``precision.weight_dtype`` gives the frozen base (their optimizer
state follows them); they compute in the activations' dtype, which is what
``precision.param_dtype`` / ``compute_dtype`` decide, as for every other weight.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from titan_plugins.errors import ConfigError
from titan_plugins.peft.config import lora_enabled
from titan_plugins.peft.experts import (
    GroupedLoRA,
    add_expert_adapters,
    expert_weight_key,
    is_expert_weight,
)
from titan_plugins.peft.targets import canonical_name, match_targets

if TYPE_CHECKING:

    from titan_plugins.peft.config import PeftConfig

__all__ = [
    "LoRALinear",
    "adapter_modules",
    "apply_lora",
    "freeze_base",
    "init_adapters",
    "is_adapter_key",
    "lora_enabled",
    "merge_into",
]

ADAPTER_KEYS = (".lora_A.weight", ".lora_B.weight")


def is_adapter_key(key: str) -> bool:
    """Whether a state-dict key belongs to a LoRA adapter."""
    return key.endswith(ADAPTER_KEYS)


class _Adapter(nn.Module):
    """Holds one adapter matrix as ``weight`` (PEFT's ``lora_A`` / ``lora_B``)."""

    def __init__(self, out_features: int, in_features: int, device: torch.device | str | None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, device=device, dtype=torch.float32))


class LoRAMixin:
    """The LoRA forward on top of the class's own (``nn.Linear`` or a subclass)."""

    lora_A: _Adapter
    lora_B: _Adapter
    lora_dropout: nn.Module
    scaling: float

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)  # type: ignore[misc]
        h = self.lora_dropout(x)
        a, b = self.lora_A.weight, self.lora_B.weight
        delta = F.linear(F.linear(h, a.to(h.dtype)), b.to(h.dtype))
        return out + (delta * self.scaling).to(out.dtype)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rank={self.lora_A.weight.shape[0]}, scaling={self.scaling}"  # type: ignore[misc]


class LoRALinear(LoRAMixin, nn.Linear):
    """An ``nn.Linear`` with a LoRA adapter pair (see the module docstring). Computes in
    its input's dtype: ``components.compute_dtype.linear`` calls it with the input cast
    to the compute dtype (``precision.compute_dtype``, or ``param_dtype`` on one rank)
    instead of reading its weight, so the adapter runs under every precision."""

    computes_in_input_dtype = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if not (x.is_floating_point() and w.is_floating_point() and x.dtype != w.dtype):
            return super().forward(x)
        bias = None if self.bias is None else self.bias.to(x.dtype)
        out = F.linear(x, w.to(x.dtype), bias)
        h = self.lora_dropout(x)
        delta = F.linear(F.linear(h, self.lora_A.weight.to(x.dtype)), self.lora_B.weight.to(x.dtype))
        return out + delta * self.scaling


_CLASSES: dict[type, type] = {nn.Linear: LoRALinear}


def _lora_class(cls: type) -> type:
    """``LoRALinear`` for ``nn.Linear``; a LoRA subclass of a plugin's own linear type
    (its forward must compute ``x W^T (+ b)`` with ``W`` of shape ``[out, in]``)."""
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"LoRA{cls.__name__}", (LoRAMixin, cls), {"__module__": cls.__module__})
    return _CLASSES[cls]


def _convert(module: nn.Linear, rank: int, alpha: float, dropout: float) -> None:
    device = module.weight.device
    module.__class__ = _lora_class(type(module))
    module.lora_A = _Adapter(rank, module.in_features, device)
    module.lora_B = _Adapter(module.out_features, rank, device)
    module.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
    module.scaling = alpha / rank


def apply_lora(model: nn.Module, peft: PeftConfig, exclude: tuple[str, ...] = ()) -> list[str]:
    """Freeze ``model`` and give every ``nn.Linear`` and grouped expert weight that
    ``peft.target_modules`` names an adapter pair; returns their FQNs. Works on the
    meta device."""
    names = match_targets(model, list(peft.target_modules), exclude)
    rank, alpha, dropout = int(peft.rank), float(peft.alpha), float(peft.dropout)
    experts = [n for n in names if is_expert_weight(model, n)]
    method = getattr(peft, "method", None)
    if experts and str(getattr(method, "value", method)) == "qlora":
        raise ConfigError(
            f"peft.method=qlora: peft.target_modules names the grouped MoE expert weights "
            f"{experts[0]}, which the 4-bit base does not hold (nn.Linear only); use peft=lora for them"
        )
    for name in names:
        if name not in experts:
            _convert(model.get_submodule(name), rank, alpha, dropout)
    add_expert_adapters(model, experts, rank, alpha, dropout)
    freeze_base(model)
    return names


def freeze_base(model: nn.Module) -> None:
    """Only adapters train. Called again after the plugin's parallelize hook: torch's
    TP styles re-create replicated parameters (norms under ``SequenceParallel``,
    ``ReplicateParallel``) with ``requires_grad=True``."""
    keep = {id(p) for p in adapter_parameters(model)}
    for param in model.parameters():
        param.requires_grad_(id(param) in keep)


def adapter_modules(model: nn.Module) -> Iterator[tuple[str, LoRAMixin | GroupedLoRA]]:
    """``(model FQN, module)`` of every adapter pair (wrapper names removed): each
    adapted linear, and each adapted expert weight's :class:`GroupedLoRA`
    (``layers.0.moe.experts.lora.w1``). Both have ``lora_A.weight``, ``lora_B.weight``
    and ``scaling``."""
    for name, module in model.named_modules():
        if isinstance(module, (LoRAMixin, GroupedLoRA)):
            yield canonical_name(name), module


def _local_slices(value: torch.Tensor) -> tuple[torch.Tensor, tuple[slice, ...]]:
    from titan_plugins.distributed.shards import local_slices

    return local_slices(value)


@torch.no_grad()
def set_full(param: torch.Tensor, full: torch.Tensor) -> None:
    """Copy the full tensor ``full`` into ``param``'s local shard (plain or DTensor)."""
    local, index = _local_slices(param)
    if local.numel():
        local.copy_(full[index].to(dtype=local.dtype, device=local.device))


@torch.no_grad()
def init_adapters(model: nn.Module, seed: int) -> None:
    """``A`` as ``nn.Linear``'s default (PEFT's): uniform in ``+-1/sqrt(in)``, drawn
    per module from a generator seeded by ``seed`` and the module's name, so the
    values do not depend on the parallel layout; ``B`` zero. (Grouped pairs: the whole
    ``[E, r, in]`` tensor from one generator.)"""
    for name, module in adapter_modules(model):
        a = module.lora_A.weight
        gen = torch.Generator().manual_seed(int(seed) * 1_000_003 + zlib.crc32(name.encode()))
        bound = 1.0 / (a.shape[-1] ** 0.5)
        full = torch.empty(tuple(a.shape), dtype=torch.float32).uniform_(-bound, bound, generator=gen)
        set_full(a, full)
        module.lora_B.weight.zero_()


def adapter_parameters(model: nn.Module) -> Iterator[torch.Tensor]:
    for _, module in adapter_modules(model):
        yield module.lora_A.weight
        yield module.lora_B.weight


@torch.no_grad()
def merge_into(state_dict: dict[str, torch.Tensor], adapters: dict[str, torch.Tensor], scaling: float) -> dict[str, torch.Tensor]:
    """Our full ``state_dict`` with every adapter folded into its base weight
    (``W + scaling * B A`` in fp32, cast back; per expert for grouped pairs, ``B_e A_e``
    into ``W[e]``) and no adapter keys left. A QLoRA base weight (NF4, a live model's)
    is dequantized first: the merged model is what the run trained, the base's
    quantization error included."""
    out = {k: v for k, v in state_dict.items() if not is_adapter_key(k)}
    for key in adapters:
        if not key.endswith(".lora_A.weight"):
            continue
        module = key[: -len(".lora_A.weight")]
        a, b = adapters[key].float(), adapters[f"{module}.lora_B.weight"].float()
        base = expert_weight_key(module) if a.ndim == 3 else f"{module}.weight"
        w = out[base]
        if hasattr(w, "get_original_weight"):  # a QLoRA base (NF4): dequantized, then merged
            w = w.get_original_weight()
        out[base] = (w.float() + scaling * (b @ a)).to(w.dtype)  # batched per expert when 3-D
    return out
