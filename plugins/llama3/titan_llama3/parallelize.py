"""Llama 3's parallelize hook: TP/SP -> activation checkpointing -> compile -> FSDP
(``titan_plugins.distributed.decoder.parallelize_decoder``).

Tensor parallelism keeps activations as DTensors through the whole region: embedding,
attention and SwiGLU run on DTensors, the norms sequence-parallel, the logits a
``Shard(-1)`` DTensor under loss parallel. ``inner_attention`` (rotary embedding +
kernel) gets plain local heads, so ``freqs_cis`` (complex) stays a plain buffer and
passes through untouched. Each pipeline stage parallelizes only the modules it owns.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from titan_llama3.config import validate
from titan_plugins.distributed import tensor_parallel as tpp
from titan_plugins.distributed.decoder import parallelize_decoder

__all__ = ["apply_tp", "parallelize"]

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from titan_plugins.distributed.parallel_dims import ParallelDims


def parallelize(model: nn.Module, parallel_dims: ParallelDims, job_config: DictConfig) -> nn.Module:
    validate(model.config, parallel_dims)
    return parallelize_decoder(model, parallel_dims, job_config, apply_tp)


def apply_tp(model: nn.Module, tp_mesh, *, sequence_parallel: bool, loss_parallel: bool) -> None:
    """The tensor/sequence-parallel plan (modules this stage lacks are skipped).
    attention(x, freqs_cis, mask): the rotary cache and the mask pass through plain."""
    tpp.apply_decoder_tp(
        model, tp_mesh, lambda block, sp: tpp.decoder_block_plan(sp, tpp.gqa_attention_plan(sp, None, None), feed_forward=True),
        sequence_parallel=sequence_parallel, loss_parallel=loss_parallel,
    )
