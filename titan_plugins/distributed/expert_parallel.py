"""Expert parallelism for ``titan_plugins.components.moe.MoE``.

Call ``apply_moe_parallel(moe, tp_mesh=..., ep_mesh=..., etp_enabled=...,
sequence_parallel=...)`` once per MoE module, from a model's parallelize hook,
after the model's own attention/dense TP plan and before activation checkpointing,
compile and FSDP. The model's TP plan must leave ``moe`` and everything under it
alone: this function owns the MoE's weights and its block boundary.

Modes (chosen from the meshes):

==========================  =========================================================
``ep_mesh`` only            EP, ETP=1 without TP: experts ``Shard(0)`` on ``ep``
``ep_mesh`` + ``tp_mesh``,  EP, ETP=1, EP borrowing the TP ranks: experts ``Shard(0)``
``etp_enabled=False``       on ``ep``; router and shared experts replicated on ``tp``
``ep_mesh`` + ``tp_mesh``,  EP with ETP=TP: experts ``[Shard(0), Shard(1|2)]`` on
``etp_enabled=True``        ``ep x tp``; shared experts column/row-parallel on ``tp``
``tp_mesh`` only            EP=1, TP: experts tensor-parallel (``w1``/``w3`` on the
                            hidden dim, ``w2`` reducing to Partial), shared experts too
==========================  =========================================================

Layer boundary (what the model hands the MoE and gets back):

* No ``tp_mesh``: input and output are plain ``(batch, seq, dim)`` tensors (the rank's
  own data-parallel batch).
* With ``tp_mesh``: the input is a DTensor on ``tp_mesh``, ``Shard(1)`` (sequence
  dim) when ``sequence_parallel`` and ``Replicate()`` otherwise; the output is a
  DTensor of the same shape and the same placement. (Another placement is
  redistributed to that one on entry.) Inside, everything is plain local tensors.

Sharding contract inside the layer:

* EP, ETP=1 (with or without TP): every rank routes only its own tokens; under TP
  that is its sequence shard (without sequence parallelism it takes its shard of
  the replicated input locally, no communication). The dispatcher sends rows to
  the experts' owners by all-to-all (counts first, then uneven token splits) and the
  combine writes back into a buffer of exactly the local shard's rows. Routed and
  shared outputs are both sequence-sharded; the boundary wraps the sum as
  ``Shard(1)`` (and all-gathers it only when the output must be ``Replicate``).
* TP experts and ETP: tokens are replicated over ``tp`` (all-gathered at entry
  under sequence parallelism); routed and shared outputs are both ``Partial``; the
  boundary alone reduces the sum (reduce-scatter to ``Shard(1)``, or all-reduce).
* Sequence lengths not divisible by the TP degree: DTensor's uneven ``Shard(1)``
  (torch.chunk sizes; the last ranks may hold fewer, even zero, rows). Each rank
  computes its real rows only; padding to ``num_local_tokens_after_padding``
  (``ceil(seq / tp)``) exists only inside the all-gather / reduce-scatter buffers.

Gradients: parameters replicated on ``tp`` while their inputs are sequence shards
(router gate and shared experts in EP, ETP=1) get their gradient all-reduced over
``tp`` in backward; expert weights are DTensors whose local shards receive complete
gradients for their experts (FSDP on ``expert_fsdp`` then reduces across data
parallel). LoRA adapters of the experts are sharded like their weight (both halves
``Shard(0)`` under EP; under TP experts the half that is whole over ``tp`` has its
gradient summed there, ``GroupedExperts.low_rank``). ``tokens_per_expert`` then
differs across ``tp`` peers in EP, ETP=1; ``build_load_balance_hooks`` reads
``moe.parallel.routes_sequence_shards`` to sum over ``tp`` as well.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import (
    DTensor,
    Partial,
    Placement,
    Replicate,
    Shard,
    distribute_tensor,
)

from titan_plugins.components.moe.moe import MoE
from titan_plugins.components.moe.token_dispatch import AllToAllTokenDispatcher

if TYPE_CHECKING:
    from titan_plugins.distributed.parallel_dims import ParallelDims

__all__ = [
    "MoEParallel",
    "apply_moe_parallel",
    "apply_moe_parallel_to_blocks",
    "num_local_tokens_after_padding",
]


def num_local_tokens_after_padding(seq_len: int, degree: int) -> int:
    """Rows per rank once ``seq_len`` is padded to a multiple of ``degree``."""
    return math.ceil(seq_len / degree)


class _AllReduceGrad(torch.autograd.Function):
    """Identity forward; backward sums the gradient over ``group``."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=ctx.group)
        return grad, None


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _distribute(module: nn.Module, name: str, mesh: DeviceMesh, placements: list[Placement]):
    param = getattr(module, name)
    if isinstance(param, DTensor):
        if param.device_mesh == mesh and tuple(param.placements) == tuple(placements):
            return
        raise RuntimeError(
            f"{type(module).__name__}.{name} is already a DTensor {param.placements}; "
            "apply_moe_parallel owns the MoE's parameters: keep them out of the model's TP plan"
        )
    dt = distribute_tensor(param.data, mesh, placements, src_data_rank=None)
    module.register_parameter(name, nn.Parameter(dt, requires_grad=param.requires_grad))


def _adapter_placements(base: list[Placement], half: str) -> list[Placement]:
    """An expert weight's LoRA half laid out like the weight ``[E, out, in]``: ``A``
    ``[E, r, in]`` follows the expert and input dims, ``B`` ``[E, out, r]`` the expert
    and output dims; on a mesh dim where the weight is sharded on the other one it is
    whole (``Replicate``; its partial gradient is summed by the experts' ``grad_sync``)."""
    keep = {"lora_A": (0, 2), "lora_B": (0, 1)}[half]
    return [p if isinstance(p, Shard) and p.dim in keep else Replicate() for p in base]


def _distribute_adapters(experts: nn.Module) -> None:
    """LoRA adapters of the experts (``GroupedExperts.adapters``) sharded with their
    weight: under EP both halves ``Shard(0)``, so each rank holds its experts' adapters."""
    pairs = experts.adapters() if hasattr(experts, "adapters") else {}
    for name, pair in pairs.items():
        base = getattr(experts, name)
        for half in ("lora_A", "lora_B"):
            placements = _adapter_placements(list(base.placements), half)
            _distribute(getattr(pair, half), "weight", base.device_mesh, placements)


class MoEParallel:
    """The installed layer boundary (``moe.parallel``); see the module docstring."""

    def __init__(
        self,
        mode: str,
        tp_mesh: DeviceMesh | None,
        dispatcher: AllToAllTokenDispatcher | None,
        sequence_parallel: bool,
    ):
        self.mode = mode  # "ep", "etp" or "tp"
        self.tp_mesh = tp_mesh
        self.tp_group = tp_mesh.get_group() if tp_mesh is not None else None
        self.dispatcher = dispatcher
        self.sequence_parallel = sequence_parallel

    @property
    def routes_sequence_shards(self) -> bool:
        """True when tp peers route different tokens (their counts must be summed)."""
        return self.mode == "ep" and self.tp_mesh is not None

    def __call__(self, moe: MoE, x: torch.Tensor) -> torch.Tensor:
        if self.tp_mesh is None:
            if isinstance(x, DTensor):
                raise TypeError("MoE without TP expects a plain tensor input, got a DTensor")
            bs, slen, dim = x.shape
            flat = x.reshape(-1, dim)
            out = moe.forward_tokens(flat, bs, moe.local_weights(_local), self.dispatcher)
            return out.view(bs, slen, dim)

        if not isinstance(x, DTensor):
            raise TypeError(
                "MoE under TP expects a DTensor on the tp mesh "
                f"({'Shard(1)' if self.sequence_parallel else 'Replicate()'}), got a plain tensor"
            )
        layout = Shard(1) if self.sequence_parallel else Replicate()
        if tuple(x.placements) != (layout,):
            x = x.redistribute(self.tp_mesh, [layout])
        group = self.tp_group

        if self.mode == "ep":
            shard = x if self.sequence_parallel else x.redistribute(self.tp_mesh, [Shard(1)])
            local = shard.to_local()
            bs, rows, dim = local.shape
            flat = local.reshape(-1, dim)
            weights = moe.local_weights(lambda p: _AllReduceGrad.apply(_local(p), group))
            out = moe.forward_tokens(flat, bs, weights, self.dispatcher, token_group=group)
            out = DTensor.from_local(
                out.view(bs, rows, dim), self.tp_mesh, [Shard(1)], shape=x.shape, stride=x.stride()
            )
            return out if self.sequence_parallel else out.redistribute(self.tp_mesh, [Replicate()])

        full = (
            x.redistribute(self.tp_mesh, [Replicate()]) if self.sequence_parallel else x
        ).to_local()
        bs, slen, dim = full.shape
        flat = full.reshape(-1, dim)
        # Experts (routed and shared) are sharded on the hidden dim, so the gradients
        # of their input and of the gating weights are partial sums over tp.
        out = moe.forward_tokens(
            flat,
            bs,
            moe.local_weights(_local),
            self.dispatcher,
            partial_grad_sync=lambda t: _AllReduceGrad.apply(t, group),
        )
        out = DTensor.from_local(out.view(bs, slen, dim), self.tp_mesh, [Partial()])
        return out.redistribute(self.tp_mesh, [layout])


def apply_moe_parallel(
    moe: MoE,
    *,
    tp_mesh: DeviceMesh | None,
    ep_mesh: DeviceMesh | None,
    etp_enabled: bool,
    sequence_parallel: bool,
) -> None:
    """Shard ``moe``'s weights and install its token dispatcher and layer boundary.

    ``tp_mesh``/``ep_mesh``: 1-D meshes (``parallel_dims.mesh("tp")`` /
    ``mesh("ep")``), ``None`` when that degree is 1. ``etp_enabled``: experts are also
    tensor-parallel over ``tp`` (ETP = TP). No-op when both meshes are ``None``.
    """
    if tp_mesh is not None and tp_mesh.size() == 1:
        tp_mesh = None
    if ep_mesh is not None and ep_mesh.size() == 1:
        ep_mesh = None
    if etp_enabled and (tp_mesh is None or ep_mesh is None):
        raise ValueError("etp_enabled needs both a tp_mesh and an ep_mesh (ETP = TP under EP)")
    if tp_mesh is None and ep_mesh is None:
        return
    experts, router, shared = moe.experts, moe.router, moe.shared_experts

    dispatcher = None
    if ep_mesh is not None:
        dispatcher = AllToAllTokenDispatcher(ep_mesh.get_group(), experts.num_experts)
    if ep_mesh is not None and not etp_enabled:
        mode = "ep"
        for name in ("w1", "w2", "w3"):
            _distribute(experts, name, ep_mesh, [Shard(0)])
    elif ep_mesh is not None:
        mode = "etp"
        ep_tp = DeviceMesh._concatenate([ep_mesh, tp_mesh])
        _distribute(experts, "w1", ep_tp, [Shard(0), Shard(1)])
        _distribute(experts, "w2", ep_tp, [Shard(0), Shard(2)])
        _distribute(experts, "w3", ep_tp, [Shard(0), Shard(1)])
    else:
        mode = "tp"
        _distribute(experts, "w1", tp_mesh, [Shard(1)])
        _distribute(experts, "w2", tp_mesh, [Shard(2)])
        _distribute(experts, "w3", tp_mesh, [Shard(1)])
    _distribute_adapters(experts)

    if tp_mesh is not None:
        _distribute(router.gate, "weight", tp_mesh, [Replicate()])
        if shared is not None:
            if mode == "ep":  # shared experts see the same sequence shard as the router
                for lin in (shared.w1, shared.w2, shared.w3):
                    _distribute(lin, "weight", tp_mesh, [Replicate()])
            else:  # column-parallel w1/w3, row-parallel w2 -> Partial, like the experts
                _distribute(shared.w1, "weight", tp_mesh, [Shard(0)])
                _distribute(shared.w2, "weight", tp_mesh, [Shard(1)])
                _distribute(shared.w3, "weight", tp_mesh, [Shard(0)])

    moe.parallel = MoEParallel(mode, tp_mesh, dispatcher, sequence_parallel)


def apply_moe_parallel_to_blocks(
    layers: Any, parallel_dims: ParallelDims, *, sequence_parallel: bool, moe_attr: str = "moe"
) -> None:
    """``apply_moe_parallel`` on the MoE of every block this stage owns.

    The step each model's parallelize hook takes after its own TP plan: blocks are
    the values of ``layers`` (missing ones skipped under PP); a block takes part when
    it has a ``moe_attr`` module that is an ``MoE``. No-op without TP and EP.
    """
    tp_mesh = parallel_dims.mesh("tp") if parallel_dims.tp_enabled else None
    ep_mesh = parallel_dims.mesh("ep") if parallel_dims.ep_enabled else None
    if tp_mesh is None and ep_mesh is None or layers is None:
        return
    for block in layers.values():
        moe = getattr(block, moe_attr, None) if block is not None else None
        if isinstance(moe, MoE):
            apply_moe_parallel(
                moe,
                tp_mesh=tp_mesh,
                ep_mesh=ep_mesh,
                etp_enabled=parallel_dims.etp_enabled and ep_mesh is not None,
                sequence_parallel=sequence_parallel,
            )
