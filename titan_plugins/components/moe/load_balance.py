"""Auxiliary-loss-free load balancing (https://arxiv.org/abs/2408.15664), as TorchTitan.

Each MoE counts ``tokens_per_expert`` in forward (gradient accumulation simply keeps
adding). Before every optimizer step the counts of all MoE layers are summed over
every rank that saw different tokens, and each layer's bias moves by
``coeff * sign(mean - count)``, centred (minus its own mean); then the counts reset.
Every rank applies the same update to the same totals, so biases stay identical.
A layer whose router gate is frozen (LoRA: ``titan_plugins.peft`` freezes the base)
keeps its bias too: routing is part of the frozen base, so an adapter-only checkpoint
and the exports (merged or PEFT over the base) hold everything the run changed.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from titan_plugins.components.moe.moe import MoE


def update_expert_bias(moes: list[MoE], groups: list[dist.ProcessGroup]) -> None:
    """All-reduce (sum) the counts over ``groups`` in turn, update biases, reset counts."""
    moes = [m for m in moes if m.load_balance_coeff is not None]
    if not moes:
        return
    with torch.no_grad():
        counts = torch.stack([m.tokens_per_expert for m in moes])
        for group in groups:
            dist.all_reduce(counts, op=dist.ReduceOp.SUM, group=group)
        for moe, count in zip(moes, counts):
            delta = moe.load_balance_coeff * torch.sign(count.mean() - count)
            moe.expert_bias.add_(delta - delta.mean())
            moe.tokens_per_expert.zero_()


def _count_groups(moe: MoE, parallel_dims) -> list[dist.ProcessGroup]:
    """Groups over which a layer's counts differ: the data-parallel ranks, the
    context-parallel peers (each routes its part of the rows), plus the
    tensor-parallel peers when each of them routes its own sequence shard."""
    groups = []
    if parallel_dims is None or not dist.is_initialized():
        return groups
    if parallel_dims.dp_size > 1:
        groups.append(parallel_dims.mesh("dp").get_group())
    if getattr(parallel_dims, "cp", 1) > 1:
        groups.append(parallel_dims.mesh("cp").get_group())
    if getattr(moe.parallel, "routes_sequence_shards", False):
        groups.append(parallel_dims.mesh("tp").get_group())
    return groups


def build_load_balance_hooks(
    model_parts: list[nn.Module], parallel_dims
) -> list[Callable[[], None]]:
    """Pre-optimizer-step callables updating every MoE's ``expert_bias`` (one per
    distinct set of reduction groups; usually exactly one). Empty when no MoE layer
    balances its load (a frozen router does not). Call them after the last backward
    of the step."""
    by_groups: dict[tuple, tuple[list[MoE], list[dist.ProcessGroup]]] = {}
    for part in model_parts:
        for module in part.modules():
            frozen = isinstance(module, MoE) and not module.router.gate.weight.requires_grad
            if isinstance(module, MoE) and module.load_balance_coeff is not None and not frozen:
                groups = _count_groups(module, parallel_dims)
                key = tuple(id(g) for g in groups)
                by_groups.setdefault(key, ([], groups))[0].append(module)
    return [
        (lambda moes=moes, groups=groups: update_expert_bias(moes, groups))
        for moes, groups in by_groups.values()
    ]
