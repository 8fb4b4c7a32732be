"""Llama 4 parallelize hook: TP/SP (DTensor through the TP region) -> MoE EP/ETP/TP
-> activation checkpointing -> compile -> FSDP, in that order.

Works on one pipeline stage as well as on the whole model: plans skip modules the
stage does not own (``None`` embeddings / norm / output, deleted blocks), and the
stage's first / last block convert hidden states between plain tensors (what
pipelining sends) and the TP activation layout. ``freqs_cis`` stays a plain buffer:
it reaches ``inner_attention`` untouched, where everything is local anyway.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn
from torch.distributed.tensor import distribute_module

from titan_plugins.distributed.activation_checkpoint import apply_activation_checkpointing
from titan_plugins.distributed.compile import apply_compile
from titan_plugins.distributed.expert_parallel import apply_moe_parallel_to_blocks
from titan_plugins.distributed.fsdp import apply_fsdp
from titan_plugins.distributed.tensor_parallel import (
    LocalAttention,
    ReplicateParallel,
    apply_tp_plan,
    colwise,
    gather_input,
    norm_style,
    owned_blocks,
    root_plan,
    rowwise,
    stage_boundary_plan,
)

__all__ = ["parallelize", "apply_tp"]

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from titan_plugins.distributed.parallel_dims import ParallelDims


class _ReplicateNorm(ReplicateParallel):
    """The shared ``ReplicateParallel`` (norms without sequence parallelism) with the
    3-argument ``output_fn`` that ``distribute_module`` takes in torch 2.13 (the shared
    helper passes a 4-argument one). Remove once fixed in ``tensor_parallel.py``."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        return distribute_module(
            module,
            device_mesh,
            partition_fn=None,
            input_fn=lambda mod, inputs, mesh: self._prepare_input(mod, inputs, mesh),
            output_fn=lambda mod, outputs, mesh: self._prepare_output(mod, None, outputs, mesh),
        )


def _norm(sequence_parallel: bool):
    return norm_style(True) if sequence_parallel else _ReplicateNorm()


def apply_tp(model: nn.Module, tp_mesh, *, sequence_parallel: bool, loss_parallel: bool) -> None:
    """Attention and dense-FFN tensor parallelism; MoE layers are left to
    ``apply_moe_parallel`` (it owns their weights and the block boundary)."""
    sp = sequence_parallel
    root = root_plan(sequence_parallel=sp, loss_parallel=loss_parallel)
    root["norm"] = _norm(sp)
    apply_tp_plan(model, tp_mesh, root)
    for block in owned_blocks(model.layers):
        plan = {
            "attention_norm": _norm(sp),
            # attention(x, freqs_cis, doc): x gathered to Replicate; the rotary cache and
            # the document ids (block_causal) passed plain
            "attention": gather_input(sp, None, None),
            "attention.wq": colwise(),
            "attention.wk": colwise(),
            "attention.wv": colwise(),
            "attention.inner_attention": LocalAttention(),
            "attention.wo": rowwise(sp),
            "ffn_norm": _norm(sp),
        }
        if not block.moe_enabled:
            plan |= {
                "feed_forward": gather_input(sp),
                "feed_forward.w1": colwise(),
                "feed_forward.w3": colwise(),
                "feed_forward.w2": rowwise(sp),
            }
        apply_tp_plan(block, tp_mesh, plan)
    apply_tp_plan(model, tp_mesh, stage_boundary_plan(model, sequence_parallel=sp))


def parallelize(model: nn.Module, parallel_dims: ParallelDims, job_config: DictConfig) -> nn.Module:
    par = job_config.parallelism
    sp = bool(par.sequence_parallel)
    tp_mesh = parallel_dims.mesh("tp") if parallel_dims.tp_enabled else None

    if tp_mesh is not None:
        apply_tp(model, tp_mesh, sequence_parallel=sp, loss_parallel=bool(par.loss_parallel))
    # EP with ETP=1 (experts Shard(0) on ep, which borrows tp), ETP=TP, or
    # tensor-parallel experts when EP is off.
    apply_moe_parallel_to_blocks(model.layers, parallel_dims, sequence_parallel=sp)

    apply_activation_checkpointing(model, job_config)
    apply_compile(model, job_config)
    apply_fsdp(model, parallel_dims, job_config, experts_attr="moe.experts")
    return model
