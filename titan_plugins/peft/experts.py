"""LoRA on grouped MoE experts (``components.moe.GroupedExperts``): per-expert adapter
pairs held as grouped tensors, opted into by name (``peft.target_modules=[experts]``,
``experts.w1``, ...; ``all-linear`` leaves the experts out).

For an expert weight ``W`` ``[E, out, in]`` (``w1``/``w3`` ``[E, hidden, dim]``, ``w2``
``[E, dim, hidden]``) the pair sits at ``<experts>.lora.<w>``: ``lora_A.weight``
``[E, r, in]`` and ``lora_B.weight`` ``[E, out, r]``, so expert ``e`` computes
``W_e x + (alpha / r) * B_e A_e dropout(x)`` on the rows routed to it, with the same
grouped GEMMs (or per-expert loop) as ``W`` (``GroupedExperts.low_rank``). ``B`` starts
at zero (step 0 is the base model bit for bit); the pairs stay fp32 like every adapter.
Expert parallelism shards both halves on dim 0 like the weights
(``distributed/expert_parallel.py``); FSDP shards them in the experts' own unit.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from titan_plugins.components.moe.experts import GroupedExperts, LowRank

__all__ = ["EXPERT_WEIGHTS", "GroupedLoRA", "LoRAExpertsMixin", "add_expert_adapters", "expert_weight_key",
           "is_expert_weight"]

EXPERT_WEIGHTS = ("w1", "w2", "w3")  # GroupedExperts' weights, [E, out, in] each
ADAPTERS = "lora"  # the ModuleDict on the experts that holds the pairs (GroupedExperts.adapters)


class _Half(nn.Module):
    """One grouped adapter matrix as ``weight`` (PEFT's ``lora_A`` / ``lora_B`` names)."""

    def __init__(self, shape: tuple[int, int, int], device: torch.device | str | None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(shape, device=device, dtype=torch.float32))


class GroupedLoRA(nn.Module):
    """The adapter pair of one expert weight ``[E, out, in]``: ``lora_A.weight``
    ``[E, r, in]``, ``lora_B.weight`` ``[E, out, r]``, ``scaling`` = alpha / r."""

    def __init__(self, shape: tuple[int, int, int], rank: int, alpha: float, dropout: float, device: torch.device | str | None) -> None:
        super().__init__()
        num_experts, out_features, in_features = shape
        self.num_experts, self.out_features, self.in_features = num_experts, out_features, in_features
        self.lora_A = _Half((num_experts, rank, in_features), device)
        self.lora_B = _Half((num_experts, out_features, rank), device)
        self.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.scaling = alpha / rank

    @property
    def shape(self) -> tuple[int, int, int]:
        """The adapted weight's ``(experts, out, in)``."""
        return self.num_experts, self.out_features, self.in_features

    def extra_repr(self) -> str:
        return f"experts={self.num_experts}, out={self.out_features}, in={self.in_features}, " \
               f"rank={self.lora_A.weight.shape[1]}, scaling={self.scaling}"


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


class LoRAExpertsMixin:
    """``GroupedExperts`` whose ``low_rank`` hands its adapter pairs to the grouped math."""

    lora: nn.ModuleDict

    def low_rank(self, dtype: torch.dtype, grad_sync: Callable[[torch.Tensor], torch.Tensor] | None = None) -> dict[str, LowRank]:
        out = {}
        for name, pair in self.lora.items():
            a, b = _local(pair.lora_A.weight), _local(pair.lora_B.weight)
            if grad_sync is not None:  # tensor-parallel experts: the half that is whole over tp
                b, a = (grad_sync(b), a) if name == "w2" else (b, grad_sync(a))
            dropout = None if isinstance(pair.lora_dropout, nn.Identity) else pair.lora_dropout
            out[name] = LowRank(a.to(dtype), b.to(dtype), pair.scaling, dropout)
        return out


_CLASSES: dict[type, type] = {}


def _experts_class(cls: type) -> type:
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"LoRA{cls.__name__}", (LoRAExpertsMixin, cls), {"__module__": cls.__module__})
    return _CLASSES[cls]


def is_expert_weight(model: nn.Module, name: str) -> bool:
    """Whether ``name`` (a parameter FQN of ``model``) is a grouped expert weight LoRA adapts."""
    owner, _, leaf = name.rpartition(".")
    try:
        module = model.get_submodule(owner)
    except AttributeError:
        return False
    return isinstance(module, GroupedExperts) and leaf in EXPERT_WEIGHTS


def add_expert_adapters(model: nn.Module, names: list[str], rank: int, alpha: float, dropout: float) -> None:
    """A :class:`GroupedLoRA` pair for every expert weight FQN in ``names`` (meta works)."""
    for name in names:
        owner, _, leaf = name.rpartition(".")
        experts = model.get_submodule(owner)
        if not isinstance(experts, LoRAExpertsMixin):
            experts.__class__ = _experts_class(type(experts))
            experts.add_module(ADAPTERS, nn.ModuleDict())
        weight = getattr(experts, leaf)
        experts.lora[leaf] = GroupedLoRA(tuple(weight.shape), rank, alpha, dropout, weight.device)
    for module in model.modules():  # w1, w2, w3 order whatever the patterns' order
        if isinstance(module, LoRAExpertsMixin):
            pairs = dict(module.lora.items())
            module.add_module(ADAPTERS, nn.ModuleDict({w: pairs[w] for w in EXPERT_WEIGHTS if w in pairs}))


def expert_weight_key(module: str) -> str | None:
    """The expert weight an adapter pair's FQN (``layers.0.moe.experts.lora.w1``) adapts
    (``layers.0.moe.experts.w1``); ``None`` for any other name."""
    owner, sep, leaf = module.rpartition(f".{ADAPTERS}.")
    return f"{owner}.{leaf}" if sep and leaf in EXPERT_WEIGHTS else None
