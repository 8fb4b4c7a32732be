"""FSDP2 (``fully_shard``) wrapping shared by every model plugin.

Called last in a plugin's parallelize hook (TP -> EP -> AC -> compile -> FSDP).
The trainer scales the loss by the global token count itself, so gradients are
*summed* across data-parallel ranks: every FSDP module gets a gradient divide
factor of 1 and sum-only reductions (gloo has no PREMUL_SUM).
"""

from __future__ import annotations

from collections.abc import Callable
from enum import Enum
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from titan_plugins.distributed.parallel_dims import ParallelDims

__all__ = ["apply_fsdp", "mixed_precision_policy", "reshard_after_forward", "to_torch_dtype"]


def _value(x: str | Enum | torch.dtype) -> str:
    """An Enum member or a plain string from a (typed or untyped) config node."""
    return str(getattr(x, "value", x))


def to_torch_dtype(name: str | Enum | torch.dtype) -> torch.dtype:
    """``"float32"`` / ``Dtype.bfloat16`` / ``"bf16"`` -> ``torch.dtype``."""
    text = _value(name)
    aliases = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}
    dtype = getattr(torch, aliases.get(text, text), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {text!r}")
    return dtype


def mixed_precision_policy(job_config: DictConfig):
    """FSDP's ``MixedPrecisionPolicy`` from ``job_config.precision``."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    precision = job_config.precision
    return MixedPrecisionPolicy(
        param_dtype=to_torch_dtype(precision.param_dtype),
        reduce_dtype=to_torch_dtype(precision.reduce_dtype),
    )


def reshard_after_forward(job_config: DictConfig, pp_enabled: bool) -> bool:
    """``parallelism.fsdp_reshard_after_forward``: ``default`` reshards unless PP is on
    (each microbatch would all-gather again), ``always`` / ``never`` as named."""
    policy = _value(job_config.parallelism.fsdp_reshard_after_forward)
    if policy == "always":
        return True
    if policy == "never":
        return False
    if policy == "default":
        return not pp_enabled
    raise ValueError(f"parallelism.fsdp_reshard_after_forward={policy!r} is not one of default, always, never")


def _get(module: nn.Module, path: str) -> nn.Module | None:
    for part in path.split("."):
        module = getattr(module, part, None)
        if module is None:
            return None
    return module


def _num_experts(experts: nn.Module) -> int:
    n = getattr(experts, "num_experts", None)
    if n is not None:
        return int(n)
    first = next(experts.parameters(), None)
    return int(first.shape[0]) if first is not None else 0  # DTensor.shape is global


def _tied(embeddings: nn.Module | None, output: nn.Module | None) -> bool:
    if embeddings is None or output is None:
        return False
    return getattr(embeddings, "weight", None) is getattr(output, "weight", False)


def apply_fsdp(
    model: nn.Module,
    parallel_dims: ParallelDims,
    job_config: DictConfig,
    *,
    layers_attr: str = "layers",
    experts_attr: str | None = None,
    embeddings_attr: str = "tok_embeddings",
    output_attr: str = "output",
) -> None:
    """Shard ``model`` with FSDP2, one unit per block.

    - every block in ``model.<layers_attr>`` (an ``nn.ModuleDict``) is its own unit on
      the ``fsdp`` mesh: 1-D ``dp_shard`` (``dp_shard x cp`` under context parallelism),
      or 2-D ``(dp_replicate, dp_shard)`` for HSDP (also when only ``dp_replicate > 1``:
      shard size 1 = pure replication);
    - under EP, each block's ``<experts_attr>`` (e.g. ``"moe.experts"``, already a
      DTensor on the ``ep`` mesh) is its own unit on the ``expert_fsdp`` mesh, sharded
      on dim 1 when ``expert_fsdp * ep > num_experts`` (dim 0 would leave ranks empty);
    - ``<embeddings_attr>``, ``(norm, <output_attr>)`` together, then the root; ``None``
      modules (pipeline stages that do not own them) are skipped; tied embeddings (the
      output weight *is* the embedding weight) stay in the root unit with the final
      norm, since separate units would shard two copies and silently untie them;
    - ``MixedPrecisionPolicy`` from ``job_config.precision``; reshard policy from
      ``parallelism.fsdp_reshard_after_forward`` (no resharding under PP by default);
    - explicit forward / backward prefetch of the neighbouring block;
    - gradient divide factor 1 with sum-only reductions (the trainer divides the loss
      by the global token count).

    A no-op when ``dp_shard == dp_replicate == cp == 1``.
    """
    from torch.distributed.fsdp import FSDPModule, fully_shard
    from torch.distributed.tensor import Shard

    if parallel_dims.dp_shard * parallel_dims.dp_replicate * getattr(parallel_dims, "cp", 1) <= 1:
        return
    mesh = parallel_dims.mesh("fsdp")
    mp_policy = mixed_precision_policy(job_config)
    reshard = reshard_after_forward(job_config, parallel_dims.pp_enabled)
    config: dict[str, Any] = {"mesh": mesh, "mp_policy": mp_policy}
    ep_on = experts_attr is not None and parallel_dims.ep_enabled

    tok_embeddings = getattr(model, embeddings_attr, None)
    norm, output = getattr(model, "norm", None), getattr(model, output_attr, None)
    tied = _tied(tok_embeddings, output)
    if tok_embeddings is not None and not tied:
        fully_shard(tok_embeddings, **config, reshard_after_forward=reshard)

    blocks: list[nn.Module] = list(getattr(model, layers_attr).values())
    experts_of: dict[int, nn.Module] = {}
    for block in blocks:
        experts = _get(block, experts_attr) if ep_on else None
        if experts is not None:
            expert_mesh = parallel_dims.mesh("expert_fsdp")
            placement_fn: Callable | None = None
            if expert_mesh.size() * parallel_dims.ep > _num_experts(experts):
                placement_fn = lambda _param: Shard(1)  # noqa: E731
            fully_shard(
                experts,
                mesh=expert_mesh,
                mp_policy=mp_policy,
                reshard_after_forward=reshard,
                shard_placement_fn=placement_fn,
            )
            experts_of[id(block)] = experts
        fully_shard(block, **config, reshard_after_forward=reshard)

    tail = [m for m in (norm, output) if m is not None and not tied]
    if tail:
        # The last modules are prefetched right after forward anyway: keep them gathered
        # unless the user asked to always reshard.
        always = _value(job_config.parallelism.fsdp_reshard_after_forward) == "always"
        fully_shard(tail if len(tail) > 1 else tail[0], **config, reshard_after_forward=always)
    fully_shard(model, **config)

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)

    _set_prefetch(blocks, experts_of, None if tied else tok_embeddings, tail)


def _set_prefetch(blocks, experts_of, tok_embeddings, tail) -> None:
    """Explicit prefetch: forward gathers block i+1 (and its experts) while block i
    runs; backward gathers block i-1 while block i's gradients reduce."""

    def unit(block):
        return [block] + ([experts_of[id(block)]] if id(block) in experts_of else [])

    tail_unit = tail[-1] if tail else None  # (norm, output) share one FSDP group on output
    if not blocks:
        return
    if tok_embeddings is not None:
        tok_embeddings.set_modules_to_forward_prefetch(unit(blocks[0]))
    for i, block in enumerate(blocks):
        if i + 1 < len(blocks):
            block.set_modules_to_forward_prefetch(unit(blocks[i + 1]))
        if i > 0:
            block.set_modules_to_backward_prefetch(unit(blocks[i - 1]))
        elif tok_embeddings is not None:
            block.set_modules_to_backward_prefetch([tok_embeddings])
    if tail_unit is not None and hasattr(tail_unit, "set_modules_to_backward_prefetch"):
        tail_unit.set_modules_to_backward_prefetch(unit(blocks[-1]))
