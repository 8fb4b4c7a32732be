"""Qwen3's parallelize hook: TP/SP -> EP -> activation checkpointing -> compile -> FSDP.

Tensor parallelism keeps activations as DTensors through the whole region
(``titan_plugins.distributed.tensor_parallel``): embedding, attention and MLP run on
DTensors, the norms sequence-parallel (q/k norms sharded on heads), the attention
kernel on plain local heads, the MoE behind its own boundary (only the block's
input and output are DTensors), and the logits a ``Shard(-1)`` DTensor under loss
parallel. Each pipeline stage parallelizes only the modules it owns.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import SequenceParallel

from titan_plugins.distributed.activation_checkpoint import apply_activation_checkpointing
from titan_plugins.distributed.compile import apply_compile
from titan_plugins.distributed.expert_parallel import apply_moe_parallel_to_blocks
from titan_plugins.distributed.fsdp import apply_fsdp
from titan_plugins.distributed.tensor_parallel import (
    LocalAttention,
    apply_tp_plan,
    colwise,
    gather_input,
    norm_style,
    owned_blocks,
    root_plan,
    rowwise,
    stage_boundary_plan,
)
from titan_qwen3.config import validate

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from titan_plugins.distributed.parallel_dims import ParallelDims


def parallelize(model: nn.Module, parallel_dims: ParallelDims, job_config: DictConfig) -> nn.Module:
    validate(model.config, parallel_dims)
    par = job_config.parallelism
    sp = bool(par.sequence_parallel)
    tp_mesh = parallel_dims.mesh("tp") if parallel_dims.tp_enabled else None
    if tp_mesh is not None:
        apply_tp(model, tp_mesh, sequence_parallel=sp, loss_parallel=bool(par.loss_parallel))
    apply_moe_parallel_to_blocks(model.layers, parallel_dims, sequence_parallel=sp)
    apply_activation_checkpointing(model, job_config, layers_attr="layers")
    apply_compile(model, job_config, layers_attr="layers")
    # Tied embeddings stay one FSDP parameter: apply_fsdp keeps them in the root unit.
    apply_fsdp(model, parallel_dims, job_config, layers_attr="layers",
               experts_attr="moe.experts" if model.config.moe_enabled else None)
    return model


def apply_tp(model: nn.Module, tp_mesh, *, sequence_parallel: bool, loss_parallel: bool) -> None:
    """The tensor/sequence-parallel plan (modules this stage lacks are skipped)."""
    sp = sequence_parallel
    apply_tp_plan(model, tp_mesh, root_plan(sequence_parallel=sp, loss_parallel=loss_parallel))
    if model.config.enable_weight_tying and model.tok_embeddings is not None and model.output is not None:
        model.output.weight = model.tok_embeddings.weight  # both Shard(0) on tp: re-tie
    for block in owned_blocks(model.layers):
        plan = {
            "attention_norm": norm_style(sp),
            # (x, rope_cache, mask): the plain rotary cache becomes a replicated
            # DTensor per call; masks pass through to the kernel untouched.
            "attention": gather_input(sp, Replicate(), None),
            "attention.wq": colwise(),
            "attention.wk": colwise(),
            "attention.wv": colwise(),
            "attention.q_norm": SequenceParallel(sequence_dim=2, use_local_output=False),
            "attention.k_norm": SequenceParallel(sequence_dim=2, use_local_output=False),
            "attention.inner_attention": LocalAttention(),
            "attention.wo": rowwise(sp),
            "ffn_norm": norm_style(sp),
        }
        if not block.moe_enabled:  # the MoE owns its boundary (apply_moe_parallel)
            plan |= {
                "feed_forward": gather_input(sp),
                "feed_forward.w1": colwise(),
                "feed_forward.w3": colwise(),
                "feed_forward.w2": rowwise(sp),
            }
        apply_tp_plan(block, tp_mesh, plan)
    apply_tp_plan(model, tp_mesh, stage_boundary_plan(model, sequence_parallel=sp))
