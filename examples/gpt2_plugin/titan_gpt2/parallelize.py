"""GPT-2 parallelisms: TP/SP -> activation checkpointing -> compile -> FSDP, with the
core's helpers; called once per pipeline stage (absent modules are None and skipped)."""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import RowwiseParallel

from titan_plugins.distributed.activation_checkpoint import apply_activation_checkpointing
from titan_plugins.distributed.compile import apply_compile
from titan_plugins.distributed.fsdp import apply_fsdp
from titan_plugins.distributed.tensor_parallel import (
    LocalAttention,
    activation_layout,
    apply_tp_plan,
    colwise,
    gather_input,
    norm_style,
    owned_blocks,
    root_plan,
    rowwise,
    stage_boundary_plan,
)


def parallelize(model: nn.Module, parallel_dims: Any, job_config: Any) -> nn.Module:
    if parallel_dims.tp_enabled:
        apply_tp(model, parallel_dims.mesh("tp"), job_config)
    apply_activation_checkpointing(model, job_config)
    apply_compile(model, job_config)
    apply_fsdp(model, parallel_dims, job_config)
    return model


def apply_tp(model: nn.Module, tp_mesh: Any, job_config: Any) -> None:
    sp = bool(job_config.parallelism.sequence_parallel)
    lp = bool(job_config.parallelism.loss_parallel)
    plan = root_plan(sequence_parallel=sp, loss_parallel=lp)
    # The position table is sharded like the token table: positions [1, S] come in
    # replicated, hidden states leave in the activation layout.
    plan["pos_embeddings"] = RowwiseParallel(
        input_layouts=Replicate(), output_layouts=activation_layout(sp), use_local_output=False
    )
    apply_tp_plan(model, tp_mesh, plan)
    for block in owned_blocks(model.layers):
        apply_tp_plan(block, tp_mesh, {
            "attention_norm": norm_style(sp),
            "attention": gather_input(sp),
            "attention.wq": colwise(),
            "attention.wk": colwise(),
            "attention.wv": colwise(),
            "attention.inner_attention": LocalAttention(),
            "attention.wo": rowwise(sp),
            "ffn_norm": norm_style(sp),
            "feed_forward": gather_input(sp),
            "feed_forward.fc": colwise(),
            "feed_forward.proj": rowwise(sp),
        })
    apply_tp_plan(model, tp_mesh, stage_boundary_plan(model, sequence_parallel=sp))
