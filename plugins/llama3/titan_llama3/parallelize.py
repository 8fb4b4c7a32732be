"""Llama 3's parallelize hook: TP/SP -> activation checkpointing -> compile -> FSDP.

Tensor parallelism keeps activations as DTensors through the whole region
(``titan_plugins.distributed.tensor_parallel``): embedding, attention and SwiGLU run on
DTensors, the norms sequence-parallel, the logits a ``Shard(-1)`` DTensor under loss
parallel. ``inner_attention`` (rotary embedding + kernel) gets plain local heads, so
``freqs_cis`` (complex) stays a plain buffer and passes through untouched. Each pipeline
stage parallelizes only the modules it owns (``tok_embeddings``/``norm``/``output`` may
be None; a stage's first/last block converts hidden states at the stage boundary).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from titan_llama3.config import validate
from titan_plugins.distributed.activation_checkpoint import apply_activation_checkpointing
from titan_plugins.distributed.compile import apply_compile
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

__all__ = ["apply_tp", "parallelize"]

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from titan_plugins.distributed.parallel_dims import ParallelDims


def parallelize(model: nn.Module, parallel_dims: ParallelDims, job_config: DictConfig) -> nn.Module:
    validate(model.config, parallel_dims)
    par = job_config.parallelism
    tp_mesh = parallel_dims.mesh("tp") if parallel_dims.tp_enabled else None
    if tp_mesh is not None:
        apply_tp(model, tp_mesh, sequence_parallel=bool(par.sequence_parallel),
                 loss_parallel=bool(par.loss_parallel))
    apply_activation_checkpointing(model, job_config, layers_attr="layers")
    apply_compile(model, job_config, layers_attr="layers")
    # Tied embeddings stay one FSDP parameter: apply_fsdp keeps them in the root unit.
    apply_fsdp(model, parallel_dims, job_config, layers_attr="layers")
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
            # attention(x, freqs_cis, mask): x gathered to Replicate; the rotary cache
            # and the mask pass through plain to inner_attention.
            "attention": gather_input(sp, None, None),
            "attention.wq": colwise(),
            "attention.wk": colwise(),
            "attention.wv": colwise(),
            "attention.inner_attention": LocalAttention(),
            "attention.wo": rowwise(sp),
            "ffn_norm": norm_style(sp),
            "feed_forward": gather_input(sp),
            "feed_forward.w1": colwise(),
            "feed_forward.w3": colwise(),
            "feed_forward.w2": rowwise(sp),
        }
        apply_tp_plan(block, tp_mesh, plan)
    apply_tp_plan(model, tp_mesh, stage_boundary_plan(model, sequence_parallel=sp))
