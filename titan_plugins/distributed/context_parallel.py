"""Context parallelism (``parallelism.cp``): the train step's side and the checks before launch.

The cp peers of a rank load the same rows (the ``dp`` mesh leaves cp out). Before the
forward each keeps its load-balanced part of every row (``shard_batches``: inputs,
labels and packed document ids alike, chunk ``r`` and chunk ``2 cp - 1 - r`` of ``2 cp``);
the model then runs on those positions under ``cp_attention.sharded_sequence``: RoPE
takes the rows of the global positions, every attention layer gathers the row's keys
and values over the cp group, masks (causal, documents, chunks) use global positions
and the whole row's document ids (``titan_plugins.components.cp_attention``). The
loss's token count and its sum run over ``dp x cp`` (the ``dp_cp`` mesh); gradients
are summed by FSDP over ``dp_shard x cp`` (``parallel_dims``). MoE load-balancing counts
are summed over cp too (``components.moe.load_balance``).

Refused before launch, one line each (``check_context_parallel``): a row length that
does not split into ``2 cp`` chunks, a model whose spec does not declare CP
(``Capabilities.cp``), and the combinations not done yet: ``training.compile``,
QLoRA (its 4-bit base is cut over ``dp_shard`` alone), an objective other than ``sft``,
``dpo`` and ``grpo`` (their per-row terms are summed over the cp group:
``cp_attention.row_sum``), DPO's ``precompute_ref``, ``attn_backend=flex``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from titan_plugins.components.cp_attention import SequenceShard, load_balanced_positions
from titan_plugins.errors import ConfigError

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from titan_plugins.distributed.parallel_dims import ParallelDims

__all__ = ["ContextParallel", "check_context_parallel", "context_parallel"]


class ContextParallel:
    """This rank's place in its cp group (``parallel_dims.mesh("cp")``)."""

    def __init__(self, dims: ParallelDims) -> None:
        mesh = dims.mesh("cp")
        self.group = mesh.get_group()
        self.rank, self.size = mesh.get_local_rank(), dims.cp
        self.loss_group = dims.mesh("dp_cp").get_group()  # every rank holding other tokens
        self._shards: dict[int, SequenceShard] = {}

    def shard(self, seq_len: int) -> SequenceShard:
        """The sequence shard of rows of ``seq_len`` tokens (the attention's state)."""
        if seq_len not in self._shards:
            if seq_len % (2 * self.size):
                raise ConfigError(f"parallelism.cp={self.size}: a row of {seq_len} tokens does not split "
                                  f"into 2*cp={2 * self.size} equal chunks")
            self._shards[seq_len] = SequenceShard(self.group, self.rank, self.size, seq_len)
        return self._shards[seq_len]

    def shard_batches(self, batches: list[Any], make: Callable[..., Any]) -> tuple[SequenceShard, list[Any]]:
        """Each batch's ``(inputs, labels)`` and ``doc_ids`` cut to this rank's positions
        (dim 1), rebuilt as ``make(inputs, labels, doc_ids)`` (or by the batch's own
        ``positions(index)`` where it carries more per position), and the shard they
        belong to (one row length per step)."""
        lengths = {int(b[0].shape[1]) for b in batches}
        if len(lengths) != 1:
            raise ConfigError(f"parallelism.cp={self.size}: the microbatches of a step have rows of "
                              f"{sorted(lengths)} tokens; context parallel needs one length")
        shard = self.shard(lengths.pop())
        out = []
        for batch in batches:
            inputs, labels = batch[0], batch[1]
            if tuple(labels.shape[:2]) != tuple(inputs.shape[:2]):
                raise ConfigError(f"parallelism.cp={self.size}: labels {tuple(labels.shape)} do not match "
                                  f"the inputs {tuple(inputs.shape)} position for position")
            index = load_balanced_positions(shard.seq_len, self.size, self.rank, inputs.device)
            if hasattr(batch, "positions"):  # a batch with per-position extras cuts itself (RolloutBatch)
                out.append(batch.positions(index))
                continue
            doc_ids = getattr(batch, "doc_ids", None)
            out.append(make(inputs.index_select(1, index), labels.index_select(1, index.to(labels.device)),
                             None if doc_ids is None else doc_ids.index_select(1, index.to(doc_ids.device))))
        return shard, out

    def sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """All-reduce (sum) ``tensor`` over the cp group, in place; returns it."""
        dist.all_reduce(tensor, group=self.group)
        return tensor


def context_parallel(dims: ParallelDims | None) -> ContextParallel | None:
    """This rank's :class:`ContextParallel`, or None without CP (``parallelism.cp=1``)."""
    if dims is None or getattr(dims, "cp", 1) <= 1:
        return None
    cached = getattr(dims, "_context_parallel", None)  # one per layout: its shards cache masks
    if cached is None:
        cached = ContextParallel(dims)
        dims._context_parallel = cached
    return cached


def _value(x: Any) -> str:
    return str(getattr(x, "value", x))


def check_context_parallel(job: DictConfig, model_name: str, model_config: Any, dims: ParallelDims) -> None:
    """Every refusal of ``parallelism.cp`` that can be decided before launch (one line)."""
    cp = dims.cp
    if cp <= 1:
        return
    seq = int(job.training.seq_len)
    if seq % (2 * cp):
        raise ConfigError(f"training.seq_len={seq} does not split into 2*cp={2 * cp} equal chunks "
                          f"(parallelism.cp={cp} needs seq_len divisible by {2 * cp})")
    not_yet = [
        (bool(job.training.get("compile")), "training.compile=true"),
        (job.get("peft") is not None and _value(job.peft.get("method", "none")) == "qlora", "peft.method=qlora"),
    ]
    for hit, what in not_yet:
        if hit:
            raise ConfigError(f"parallelism.cp={cp} with {what}: not done yet (context parallel runs with "
                              "FSDP, HSDP, TP and LoRA)")
    objective = job.get("objective")
    name = _value(objective.get("name", "sft")) if objective is not None else "sft"
    if name not in ("sft", "dpo", "grpo"):
        raise ConfigError(f"objective={name} with parallelism.cp={cp}: not done yet (its per-row terms are not "
                          "summed over the cp group); context parallel trains objective=sft, dpo and grpo")
    if name == "dpo" and objective.get("precompute_ref"):
        raise ConfigError(f"objective.precompute_ref=true with parallelism.cp={cp}: not done yet (the first pass "
                          "stores whole rows' log-probs); use the frozen reference (precompute_ref=false)")
    if _value(getattr(model_config, "attn_backend", "auto")) == "flex":
        raise ConfigError(f"model.attn_backend=flex with parallelism.cp={cp}: context parallel runs SDPA "
                          "with a boolean mask over the gathered keys; use model.attn_backend=auto or sdpa")
