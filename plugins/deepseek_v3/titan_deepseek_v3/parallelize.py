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

from titan_plugins.distributed.decoder import parallelize_decoder
from titan_plugins.distributed.tensor_parallel import (
    LocalAttention,
    ReplicateParallel,
    apply_decoder_tp,
    colwise,
    decoder_block_plan,
    gather_input,
    rowwise,
)
from titan_plugins.errors import ConfigError

OUTPUT = "lm_head"

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from titan_plugins.distributed.parallel_dims import ParallelDims


def parallelize(model: nn.Module, parallel_dims: ParallelDims, job_config: DictConfig) -> nn.Module:
    seq_len = int(job_config.training.seq_len)
    if seq_len > model.config.max_seq_len:
        raise ConfigError(
            f"training.seq_len={seq_len} exceeds model.max_seq_len={model.config.max_seq_len}"
        )
    return parallelize_decoder(model, parallel_dims, job_config, apply_tp, output_attr=OUTPUT)


def _mla_plan(block: nn.Module, sp: bool) -> dict:
    """MLA: per-head projections column-wise, the latent down projections replicated."""
    plan = {
        "attention": gather_input(sp, Replicate()),  # (x, freqs_cis)
        "attention.wkv_a": ReplicateParallel(),
        "attention.kv_norm": ReplicateParallel(),
        "attention.wkv_b": colwise(),
        "attention.inner_attention": LocalAttention(),
        "attention.wo": rowwise(sp),
    }
    if block.attention.q_lora_rank == 0:
        plan["attention.wq"] = colwise()
    else:
        plan |= {"attention.wq_a": ReplicateParallel(), "attention.q_norm": ReplicateParallel(),
                 "attention.wq_b": colwise()}
    return decoder_block_plan(sp, plan, feed_forward=not block.moe_enabled)


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, *, sequence_parallel: bool, loss_parallel: bool) -> None:
    """Tensor + sequence parallelism for everything but the MoE layers."""
    apply_decoder_tp(model, tp_mesh, _mla_plan, sequence_parallel=sequence_parallel,
                     loss_parallel=loss_parallel, output=OUTPUT)
