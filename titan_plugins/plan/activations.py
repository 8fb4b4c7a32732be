"""Activation memory per rank: an estimate from the parallelized blocks' shapes.

Notation: ``T = b * s / cp`` tokens per microbatch (``b = training.local_batch_size``,
divided by the number of pipeline microbatches under PP; ``s = training.seq_len``;
``cp`` the context-parallel degree, whose keys/values and mask are added as
``plan/context_parallel.py`` says),
``c`` the bytes of the compute dtype (``precision.compute_dtype``, else
``precision.param_dtype``), ``t`` the TP degree when sequence parallelism is on
(else 1). Shapes are the TP/EP-local shapes a rank computes with (FSDP sharding
does not shrink activations).

One block, no checkpointing, keeps for backward::

    A = c * ( sum over nn.Linear      T_l * (in + out)        # saved input and the output the
                                                                # next op saves (norm, act, SDPA)
            + sum over norms          T_n * width             # their input
            + sum over grouped experts T_e * k * (2 d + 3 h) )  # routed copies: w1/w3 input, the
                                                                # two hidden outputs and their
                                                                # product, w2 output

with ``T_l = T`` inside the tensor-parallel region, ``T / t`` for the residual
stream norms and for everything inside an MoE that routes sequence shards (EP
with ETP=1); ``k`` the router's ``top_k``, ``d`` x ``h`` an expert's local shape.
Attention is taken as a fused kernel (flash / memory-efficient SDPA): no
``s x s`` score matrix.

A checkpointed block keeps only its input, ``c * (T / t) * d``; its full ``A``
comes back once during recompute (one block per stage). ``selective`` is read
from the model: whichever blocks the runtime wrapped.

A stage holds its blocks' activations for ``m`` microbatches at once:
GPipe ``m = n_mb``; 1F1B ``m = min(n_mb, pp - pp_rank)``; Interleaved1F1B
(``v`` stages per rank) ``m = min(n_mb v, (v - 1) pp + 2 (pp - 1 - pp_rank) + 1) / v``
per local stage. Without PP, ``m = 1`` (gradient accumulation frees between
microbatches). The last stage adds one microbatch of logits,
``T * V_local * (c + 4)`` (the loss upcasts to float32).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from titan_plugins.plan.context_parallel import kv_width, mask_bytes
from titan_plugins.plan.sharding import model_parallel_shape

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from titan_plugins.distributed.parallel_dims import ParallelDims

__all__ = ["ActivationEstimate", "estimate_activations", "in_flight_microbatches"]


@dataclass
class ActivationEstimate:
    tokens_per_microbatch: int
    microbatch_size: int
    in_flight: float
    blocks: list[dict[str, Any]] = field(default_factory=list)  # per block: key, checkpointed, bytes
    recompute_bytes: int = 0
    logits_bytes: int = 0
    cp_mask_bytes: int = 0  # context parallel: the boolean mask of one forward
    total_bytes: int = 0
    dtype: str = "float32"


def _value(x: Any) -> str:
    return str(getattr(x, "value", x))


def in_flight_microbatches(job: DictConfig, pp_rank: int) -> float:
    par = job.parallelism
    pp = int(par.pp)
    if pp <= 1:
        return 1.0
    v = int(par.pp_stages_per_rank)
    n_mb = int(par.pp_microbatches or pp * v)
    schedule = _value(par.pp_schedule)
    if schedule == "GPipe":
        return float(n_mb)
    if schedule == "Interleaved1F1B":
        return min(n_mb * v, (v - 1) * pp + 2 * (pp - 1 - pp_rank) + 1) / v
    return float(min(n_mb, pp - pp_rank))


def _is_checkpointed(block: nn.Module) -> bool:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    return isinstance(block, CheckpointWrapper) or isinstance(
        getattr(block, "_orig_mod", None), CheckpointWrapper
    )


def _moe_prefixes(block: nn.Module) -> dict[str, Any]:
    """``{module name: module}`` for MoE layers (modules owning 3-D expert weights)."""
    out = {}
    for name, module in block.named_modules():
        for child in module.children():
            if any(p.ndim == 3 for p in child.parameters(recurse=False)):
                out[name] = module
    return out


def _strip_wrappers(name: str) -> str:
    """A module name without the AC / compile wrapper segments."""
    parts = [p for p in name.split(".") if p not in ("_checkpoint_wrapped_module", "_orig_mod")]
    return ".".join(parts)


def _top_k(module: nn.Module) -> int:
    for m in module.modules():
        k = getattr(m, "top_k", None)
        if isinstance(k, int):
            return k
    return 1


def block_activation_elems(block: nn.Module, tokens: int, sp: int, dim: int) -> tuple[int, int]:
    """``(elements kept without checkpointing, elements of the block input)``."""
    moes = _moe_prefixes(block)
    seq_shard_moes = {n for n, m in moes.items()
                      if getattr(getattr(m, "parallel", None), "routes_sequence_shards", False)}

    def tokens_for(name: str, default: int) -> int:
        for prefix in seq_shard_moes:
            if prefix == "" or name == prefix or name.startswith(prefix + "."):
                return tokens // sp
        return default

    elems = 0
    for name, module in block.named_modules():
        own = list(module.named_parameters(recurse=False))
        if not own:
            continue
        if isinstance(module, nn.Linear):
            out_f, in_f = model_parallel_shape(module.weight)
            elems += tokens_for(name, tokens) * (in_f + out_f)
        elif any(p.ndim == 3 for _, p in own):
            w1 = dict(own).get("w1", next(p for _, p in own if p.ndim == 3))
            _, h, d = model_parallel_shape(w1)
            elems += tokens_for(name, tokens) * _top_k(moes.get(name.rpartition(".")[0], block)) * (2 * d + 3 * h)
        elif all(p.ndim == 1 for _, p in own):  # a norm
            width = model_parallel_shape(own[0][1])[0]
            residual = "." not in _strip_wrappers(name)  # a direct child: the residual stream
            elems += (tokens // sp if residual else tokens_for(name, tokens)) * width
    return elems, (tokens // sp) * dim


def _hidden_dim(model: nn.Module) -> int:
    config = getattr(model, "config", None)
    dim = getattr(config, "dim", None)
    if isinstance(dim, int):
        return dim
    # Fallback: the width of the first norm of the first block.
    for p in model.parameters():
        if p.ndim == 1:
            return int(p.shape[0])
    return 0


def _dtype(name: Any) -> torch.dtype:
    from titan_plugins.distributed.fsdp import to_torch_dtype

    return to_torch_dtype(name)


def estimate_activations(
    parts: list[nn.Module], job: DictConfig, dims: ParallelDims, pp_rank: int, layers_attr: str,
    last_modules: tuple[str, ...],
) -> ActivationEstimate:
    par, training, precision = job.parallelism, job.training, job.precision
    compute = precision.compute_dtype if precision.compute_dtype is not None else precision.param_dtype
    dtype = _dtype(compute)
    c = dtype.itemsize
    pp = int(par.pp)
    n_mb = int(par.pp_microbatches or pp * int(par.pp_stages_per_rank)) if pp > 1 else 1
    b = max(int(training.local_batch_size) // n_mb, 1)
    cp = int(getattr(dims, "cp", 1))
    tokens = b * int(training.seq_len) // cp
    sp = dims.tp if (dims.tp > 1 and bool(par.sequence_parallel)) else 1
    m = in_flight_microbatches(job, pp_rank)
    est = ActivationEstimate(tokens, b, m, dtype=str(dtype).removeprefix("torch."))
    per_microbatch = 0
    worst_full = 0
    for part in parts:
        dim = _hidden_dim(part)
        for key, block in getattr(part, layers_attr).items():
            full, inp = block_activation_elems(block, tokens, sp, dim)
            if cp > 1:  # the whole row's keys and values, gathered for SDPA
                full += b * int(training.seq_len) * kv_width(block, str(job.model.get("name", "?")))
            ckpt = _is_checkpointed(block)
            kept = inp if ckpt else full
            est.blocks.append({"layer": int(key), "checkpointed": ckpt, "bytes": kept * c})
            per_microbatch += kept * c
            if ckpt:
                worst_full = max(worst_full, full * c)
        for name in last_modules:
            module = getattr(part, name, None)
            if isinstance(module, nn.Linear):
                vocab = model_parallel_shape(module.weight)[0]
                if not bool(par.loss_parallel) and dims.tp > 1:
                    vocab = module.weight.shape[0]
                est.logits_bytes = max(est.logits_bytes, tokens * vocab * (c + 4))
    est.recompute_bytes = worst_full
    est.cp_mask_bytes = mask_bytes(job, b, cp) if cp > 1 else 0
    est.total_bytes = int(per_microbatch * m) + worst_full + est.logits_bytes + est.cp_mask_bytes
    return est
