"""Qwen3's parallelize hook: TP/SP -> EP -> activation checkpointing -> compile -> FSDP
(``titan_plugins.distributed.decoder.parallelize_decoder``).

Tensor parallelism keeps activations as DTensors through the whole region: embedding,
attention and MLP run on DTensors, the norms sequence-parallel (q/k norms sharded on
heads), the attention kernel on plain local heads, the MoE behind its own boundary
(only the block's input and output are DTensors), and the logits a ``Shard(-1)``
DTensor under loss parallel. Each pipeline stage parallelizes only the modules it owns.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn
from torch.distributed.tensor import Replicate

from titan_plugins.distributed import tensor_parallel as tpp
from titan_plugins.distributed.decoder import parallelize_decoder
from titan_qwen3.config import validate

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from titan_plugins.distributed.parallel_dims import ParallelDims


def parallelize(model: nn.Module, parallel_dims: ParallelDims, job_config: DictConfig) -> nn.Module:
    validate(model.config, parallel_dims)
    return parallelize_decoder(model, parallel_dims, job_config, apply_tp)


def _block_plan(block: nn.Module, sp: bool) -> dict:
    # attention(x, rope_cache, mask): the plain rotary cache becomes a replicated
    # DTensor per call; masks pass through to the kernel untouched.
    return tpp.decoder_block_plan(sp, tpp.gqa_attention_plan(sp, Replicate(), None), feed_forward=not block.moe_enabled)


def apply_tp(model: nn.Module, tp_mesh, *, sequence_parallel: bool, loss_parallel: bool) -> None:
    """The tensor/sequence-parallel plan (modules this stage lacks are skipped)."""
    tpp.apply_decoder_tp(model, tp_mesh, _block_plan, sequence_parallel=sequence_parallel, loss_parallel=loss_parallel)
