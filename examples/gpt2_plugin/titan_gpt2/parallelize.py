"""GPT-2's parallelize hook: TP/SP -> activation checkpointing -> compile -> FSDP
(``titan_plugins.distributed.decoder.parallelize_decoder``, the first-party plugins'
hook); called once per pipeline stage (absent modules are None and skipped).

What is GPT-2's own is its TP plan: the shared decoder plan (``apply_decoder_tp``:
embedding, final norm and output, then one plan per block, then the stage boundaries)
with the learned position table sharded like the token table, the shared attention
plan (q/k/v column-wise, the kernel on local heads, ``wo`` row-wise) and a GELU MLP
(``fc`` column-wise, ``proj`` row-wise) where the shared decoders have SwiGLU.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import RowwiseParallel

from titan_plugins.distributed import tensor_parallel as tpp
from titan_plugins.distributed.decoder import parallelize_decoder

__all__ = ["apply_tp", "parallelize"]

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from titan_plugins.distributed.parallel_dims import ParallelDims


def parallelize(model: nn.Module, parallel_dims: ParallelDims, job_config: DictConfig) -> nn.Module:
    return parallelize_decoder(model, parallel_dims, job_config, apply_tp)


def _block_plan(block: nn.Module, sp: bool) -> dict:
    # attention(x): no rotary table, no mask; the MLP is fc -> GELU -> proj
    return tpp.decoder_block_plan(sp, tpp.gqa_attention_plan(sp), feed_forward=False) | {
        "feed_forward": tpp.gather_input(sp),
        "feed_forward.fc": tpp.colwise(),
        "feed_forward.proj": tpp.rowwise(sp),
    }


def apply_tp(model: nn.Module, tp_mesh, *, sequence_parallel: bool, loss_parallel: bool) -> None:
    """The tensor/sequence-parallel plan (modules this stage lacks are skipped)."""
    # The position table is sharded like the token table: positions [1, S] come in
    # replicated, hidden states leave in the activation layout.
    tpp.apply_tp_plan(model, tp_mesh, {"pos_embeddings": RowwiseParallel(
        input_layouts=Replicate(), output_layouts=tpp.activation_layout(sequence_parallel), use_local_output=False,
    )})
    tpp.apply_decoder_tp(model, tp_mesh, _block_plan, sequence_parallel=sequence_parallel, loss_parallel=loss_parallel)
