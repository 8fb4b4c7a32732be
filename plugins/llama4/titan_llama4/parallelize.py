"""Llama 4 parallelize hook: TP/SP (DTensor through the TP region) -> MoE EP/ETP/TP
-> activation checkpointing -> compile -> FSDP, in that order
(``titan_plugins.distributed.decoder.parallelize_decoder``).

Works on one pipeline stage as well as on the whole model: plans skip modules the
stage does not own (``None`` embeddings / norm / output, deleted blocks), and the
stage's first / last block convert hidden states between plain tensors (what
pipelining sends) and the TP activation layout. ``freqs_cis`` stays a plain buffer:
it reaches ``inner_attention`` untouched, where everything is local anyway.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from titan_plugins.distributed import tensor_parallel as tpp
from titan_plugins.distributed.decoder import parallelize_decoder

__all__ = ["parallelize", "apply_tp"]

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from titan_plugins.distributed.parallel_dims import ParallelDims


def _block_plan(block: nn.Module, sp: bool) -> dict:
    # attention(x, freqs_cis, doc): the rotary cache and the document ids passed plain
    return tpp.decoder_block_plan(sp, tpp.gqa_attention_plan(sp, None, None), feed_forward=not block.moe_enabled)


def apply_tp(model: nn.Module, tp_mesh, *, sequence_parallel: bool, loss_parallel: bool) -> None:
    """Attention and dense-FFN tensor parallelism; MoE layers are left to
    ``apply_moe_parallel`` (it owns their weights and the block boundary)."""
    tpp.apply_decoder_tp(model, tp_mesh, _block_plan, sequence_parallel=sequence_parallel, loss_parallel=loss_parallel)


def parallelize(model: nn.Module, parallel_dims: ParallelDims, job_config: DictConfig) -> nn.Module:
    # EP with ETP=1 (experts Shard(0) on ep, which borrows tp), ETP=TP, or
    # tensor-parallel experts when EP is off.
    return parallelize_decoder(model, parallel_dims, job_config, apply_tp)
