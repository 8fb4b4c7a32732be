"""The microbatch loop the train step and the validator share: count, forward (the
reference's too where the objective needs it), the objective's loss, backward.

Nothing in it knows an objective by name: the objective says what a microbatch counts
(``count``), what it needs of the reference (``reference_stats``) and what its loss
and metric sums are (``loss``). Under PP the schedule runs the objective's
``pipeline_loss`` on the last stage.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from titan_plugins.errors import ConfigError

if TYPE_CHECKING:
    from titan_plugins.objectives.job import JobView

__all__ = ["add_counts", "batch_count", "global_count", "primary", "run_microbatches"]


def _local(x: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return (x.full_tensor() if isinstance(x, DTensor) else x).detach()


def global_count(run: JobView, batches: list[Any]) -> float | tuple[float, ...]:
    """The objective's count over ``batches`` summed over the data-parallel ranks; the
    same on every rank, so a 0 stops every rank together (one line)."""
    from titan_plugins.distributed.context_parallel import context_parallel

    objective = run.objective
    total = _summed_count(objective, batches)
    cp = context_parallel(getattr(run, "dims", None))  # cp: over dp x cp, the ranks holding other tokens
    group = run.dp_group if cp is None else cp.loss_group
    if group is not None:
        total = total.to(run.device)
        dist.all_reduce(total, group=group)
    return _checked(run, total)


def _summed_count(objective: Any, batches: list[Any]) -> torch.Tensor:
    return sum(objective.count(batch[1]) for batch in batches).to(torch.float64)


def _checked(run: JobView, total: torch.Tensor) -> float | tuple[float, ...]:
    count: float | tuple[float, ...] = float(total.item()) if total.dim() == 0 else tuple(total.tolist())
    if primary(count) == 0:
        raise ConfigError(run.objective.empty_message(run.config))
    return count


def batch_count(run: JobView, batches: list[Any]) -> float | tuple[float, ...]:
    """The objective's count over ``batches`` where this rank holds the whole global
    batch (fault_tolerance=torchft): no collective."""
    return _checked(run, _summed_count(run.objective, batches))


def primary(count: float | tuple[float, ...]) -> float:
    """The count a loss averages over (an objective may count more: DPO pairs and tokens)."""
    return count if isinstance(count, float) else count[0]


def add_counts(a: Any, b: Any) -> Any:
    return b if a is None else (a + b if isinstance(a, float) else tuple(x + y for x, y in zip(a, b)))


def run_microbatches(run: JobView, batches: list[Any], *, train: bool, acc_dtype: torch.dtype = torch.float32,
                     count: Any = None) -> tuple[torch.Tensor, dict[str, float], Any]:
    """``(loss, sums, count)`` of ``batches`` on this rank: ``loss`` this rank's part of
    the global loss (summed in ``acc_dtype``; the caller all-reduces it), ``sums`` the
    objective's metric numerators summed over DP, ``count`` the global count.
    ``train=True`` runs backward (and the pipeline schedule's ``step``; else ``eval``).
    Under context parallelism each rank keeps its chunks of every row (``loss`` and
    ``sums`` come back summed over the cp peers). ``count``: the global count where the
    caller has it (fault_tolerance=torchft: ``batch_count`` of the whole global batch)."""
    from titan_plugins.components.attention_masks import documents
    from titan_plugins.components.cp_attention import sharded_sequence
    from titan_plugins.data.batch import Batch
    from titan_plugins.distributed.context_parallel import context_parallel

    objective = run.objective
    cp, shard = context_parallel(getattr(run, "dims", None)), None
    if cp is not None:  # parallelism.cp: positions, masks and the K/V exchange follow the shard
        shard, batches = cp.shard_batches(batches, Batch)
    if count is None:
        with sharded_sequence(shard):  # per-row counts (DPO's pairs) are one cp rank's (owns_rows)
            count = global_count(run, batches)
    model = run.model
    objective.set_scale(count)
    loss_sum = torch.zeros((), dtype=acc_dtype, device=run.device)
    sums: dict[str, torch.Tensor] = {}
    for batch in batches:
        inputs, labels = batch[0].to(run.device), batch[1].to(run.device)
        doc_ids = getattr(batch, "doc_ids", None)
        with documents(None if doc_ids is None else doc_ids.to(run.device)) as docs, sharded_sequence(shard):
            if model.pp:
                _pipeline(run, inputs, labels, train, loss_sum)
            else:
                reference = None
                if objective.needs_reference:
                    with torch.no_grad(), run.loss_context():
                        reference = run.reference(
                            inputs, lambda out, labels=labels: objective.reference_stats(out, labels), labels)
                with run.loss_context():
                    loss, stats = objective.loss(model.parts[0](inputs), labels, scale=count, reference=reference,
                                                 **objective.loss_inputs(batch))
                    if train:
                        loss.backward()
                loss_sum += _local(loss).to(acc_dtype)
                for key, value in stats.items():
                    sums[key] = sums.get(key, 0) + _local(value).double()
        if train and docs is not None and not docs.used:
            raise ConfigError(
                f"data.name={run.config.data.name} packs several documents per row, but the model "
                "ignored their document ids (they would attend to each other): set "
                "model.attn_mask=block_causal where the model has it, or data.chat.pack=false"
            )
    if cp is not None:
        cp.sum(loss_sum)
    return loss_sum, _reduced(run, sums, cp), count


def _pipeline(run: JobView, inputs: torch.Tensor, labels: torch.Tensor, train: bool,
              loss_sum: torch.Tensor) -> None:
    """Run the schedule (the last stage computes the loss); add its microbatch losses
    to ``loss_sum`` one by one (the summation order of the step's log line)."""
    from titan_plugins.distributed.pipeline import stage_inputs

    model = run.model
    losses: list[torch.Tensor] = []
    extra = stage_inputs(model.parts[0], run.spec.pipeline, inputs)
    args = (inputs,) if model.has_first else ()
    with run.loss_context():
        run = model.schedule.step if train else model.schedule.eval
        run(*args, target=labels, losses=losses, **extra)
    for mb_loss in losses:
        loss_sum += _local(mb_loss).to(loss_sum.dtype)


def _reduced(run: JobView, sums: dict[str, torch.Tensor], cp: Any = None) -> dict[str, float]:
    if not sums:
        return {}
    keys = sorted(sums)
    flat = torch.stack([sums[k].to(run.device) for k in keys])
    if run.dp_group is not None:
        dist.all_reduce(flat, group=run.dp_group)
    if cp is not None:
        cp.sum(flat)
    return dict(zip(keys, flat.tolist()))
