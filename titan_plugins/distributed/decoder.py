"""A decoder's parallelize hook in TorchTitan's fixed order: TP/SP -> MoE EP/ETP ->
activation checkpointing -> compile -> FSDP.

Each first-party plugin's ``parallelize.py`` keeps what is its own (its tensor-parallel
plan, model checks) and hands the rest to ``parallelize_decoder``; a third-party
decoder built from ``titan_plugins.components`` can do the same.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from torch import nn

from titan_plugins.distributed.activation_checkpoint import apply_activation_checkpointing
from titan_plugins.distributed.compile import apply_compile
from titan_plugins.distributed.expert_parallel import apply_moe_parallel_to_blocks
from titan_plugins.distributed.fsdp import apply_fsdp

if TYPE_CHECKING:
    from omegaconf import DictConfig
    from torch.distributed.device_mesh import DeviceMesh

    from titan_plugins.distributed.parallel_dims import ParallelDims

__all__ = ["TPPlan", "parallelize_decoder"]

# ``apply_tp(model, tp_mesh, *, sequence_parallel, loss_parallel)``: a model's TP plan.
TPPlan = Callable[..., None]


def parallelize_decoder(
    model: nn.Module,
    parallel_dims: ParallelDims,
    job_config: DictConfig,
    apply_tp: TPPlan,
    *,
    output_attr: str = "output",
    experts_attr: str = "moe.experts",
) -> nn.Module:
    """Apply every parallelism of ``job_config`` to ``model`` (one pipeline stage or the
    whole model) and return it.

    - TP/SP: ``apply_tp(model, tp_mesh, sequence_parallel=..., loss_parallel=...)`` when
      ``tp > 1`` (``titan_plugins.distributed.tensor_parallel.apply_decoder_tp`` builds it);
    - each block's ``moe`` (if it is an MoE): EP with ETP=1 or ETP=TP, or TP experts;
    - activation checkpointing and ``torch.compile`` per block of ``model.layers``;
    - FSDP2: one unit per block, each block's ``experts_attr`` its own unit under EP,
      ``norm`` with ``output_attr`` (tied embeddings stay in the root unit).
    """
    par = job_config.parallelism
    sp = bool(par.sequence_parallel)
    if parallel_dims.tp_enabled:
        tp_mesh: DeviceMesh = parallel_dims.mesh("tp")
        apply_tp(model, tp_mesh, sequence_parallel=sp, loss_parallel=bool(par.loss_parallel))
    apply_moe_parallel_to_blocks(model.layers, parallel_dims, sequence_parallel=sp)
    apply_activation_checkpointing(model, job_config)
    apply_compile(model, job_config)
    apply_fsdp(model, parallel_dims, job_config, experts_attr=experts_attr, output_attr=output_attr)
    return model
