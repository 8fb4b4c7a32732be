"""DeepSeek-V3 parallelism, in a fixed order: TP/SP (+ loss parallel) -> EP / expert
TP -> activation checkpointing -> compile -> FSDP.

The MLA tensor-parallel plan: the projections that produce per-head tensors are
column-parallel (``wq`` or ``wq_b``, and ``wkv_b``, which expands the latent into
per-head ``k_nope`` and ``v``); the low-rank down projections ``wq_a`` / ``wkv_a``
and their norms ``q_norm`` / ``kv_norm`` are replicated (their outputs are small
and shared by every head, and ``k_pe`` is one rotary key for all heads); ``wo`` is
row-parallel. Activations stay DTensors from the embedding to ``lm_head`` (the
shared helpers in ``titan_plugins.distributed.tensor_parallel``); the attention
kernel gets local heads. ``freqs_cis`` stays a plain buffer and is wrapped as a
replicated DTensor per call by the attention module's input plan.

The MoE layers (weights, router, shared experts, the block boundary) belong to
``apply_moe_parallel``: EP with ETP=1 or ETP=TP, or tensor-parallel experts when EP
is off. Under pipeline parallelism every plan skips what the stage does not own.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate

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
from titan_plugins.errors import ConfigError

OUTPUT = "lm_head"

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from titan_plugins.distributed.parallel_dims import ParallelDims


def parallelize(model: nn.Module, parallel_dims: ParallelDims, job_config: DictConfig) -> nn.Module:
    par = job_config.parallelism
    seq_len = int(job_config.training.seq_len)
    if seq_len > model.config.max_seq_len:
        raise ConfigError(
            f"training.seq_len={seq_len} exceeds model.max_seq_len={model.config.max_seq_len}"
        )
    sp = bool(par.sequence_parallel)
    tp_mesh = parallel_dims.mesh("tp") if parallel_dims.tp_enabled else None

    if tp_mesh is not None:
        apply_tp(model, tp_mesh, sequence_parallel=sp, loss_parallel=bool(par.loss_parallel))
    apply_moe_parallel_to_blocks(model.layers, parallel_dims, sequence_parallel=sp)
    apply_activation_checkpointing(model, job_config)
    apply_compile(model, job_config)
    apply_fsdp(model, parallel_dims, job_config, experts_attr="moe.experts", output_attr="lm_head")
    return model


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, *, sequence_parallel: bool, loss_parallel: bool) -> None:
    """Tensor + sequence parallelism for everything but the MoE layers."""
    sp = sequence_parallel
    apply_tp_plan(model, tp_mesh, root_plan(sequence_parallel=sp, loss_parallel=loss_parallel, output=OUTPUT))
    for block in owned_blocks(model.layers):
        plan = {
            "attention_norm": norm_style(sp),
            "attention": gather_input(sp, Replicate()),  # (x, freqs_cis)
            "attention.wkv_a": ReplicateParallel(),
            "attention.kv_norm": ReplicateParallel(),
            "attention.wkv_b": colwise(),
            "attention.inner_attention": LocalAttention(),
            "attention.wo": rowwise(sp),
            "ffn_norm": norm_style(sp),
        }
        if block.attention.q_lora_rank == 0:
            plan["attention.wq"] = colwise()
        else:
            plan.update({
                "attention.wq_a": ReplicateParallel(),
                "attention.q_norm": ReplicateParallel(),
                "attention.wq_b": colwise(),
            })
        if not block.moe_enabled:
            plan.update({
                "feed_forward": gather_input(sp),
                "feed_forward.w1": colwise(),
                "feed_forward.w3": colwise(),
                "feed_forward.w2": rowwise(sp),
            })
        apply_tp_plan(block, tp_mesh, plan)
    apply_tp_plan(model, tp_mesh, stage_boundary_plan(model, sequence_parallel=sp, output=OUTPUT))
