"""The training loop of one rank under ``fault_tolerance=torchft``.

Per step: the quorum (``ReplicaSession.begin_step``; a restarted group heals here),
the step's whole global batch (read once, kept until the step commits), this rank's
share of it for the live participants, forward/backward inside the group as usual
with the loss normalized by the global batch's count, the gradients (and the loss)
summed over the live groups, the clip, the commit, and only then the optimizer and
lr-schedule step. A step that does not commit (a group died during it) is trained
again with the same rows under the next quorum.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from titan_plugins.distributed.clip_grad import clip_grad_norm_
from titan_plugins.distributed.fault_tolerance import ReplicaSession, share
from titan_plugins.distributed.ft_state import load_replica_state, replica_state
from titan_plugins.objectives.step import batch_count, run_microbatches

if TYPE_CHECKING:
    from titan_plugins.train.profiling import StepProfiler
    from titan_plugins.train.run_report import RunReport
    from titan_plugins.train.trainer import Trainer

__all__ = ["replica_loop", "start_session"]


def start_session(trainer: Trainer) -> ReplicaSession:
    """This rank's torchft Manager; a healing peer gets ``replica_state`` of the step
    in progress (the data position where that step's rows start)."""
    trainer.data_position = trainer.dataloader.state_dict()

    def state() -> dict[str, Any]:
        return replica_state(trainer.model.parts, trainer.optimizers, trainer.schedulers, trainer.data_position,
                             trainer.last_step, session.replica)

    def load(sent: dict[str, Any]) -> None:
        data, _step = load_replica_state(sent, trainer.model.parts, trainer.optimizers, trainer.schedulers)
        trainer.dataloader.load_state_dict(data)
        trainer.data_position = data

    session = ReplicaSession(trainer.job.fault_tolerance, group_rank=trainer.rank, group_world=trainer.world,
                             device=trainer.device, run_dir=trainer.run_dir, state_fn=state, load_fn=load)
    return session


def _local_grads(trainer: Trainer) -> list[torch.Tensor]:
    """Every trainable parameter's local gradient (zeros where backward left none, so
    that every group sends the same layout)."""
    from torch.distributed.tensor import DTensor

    grads = []
    for p in trainer.model.parameters():
        if not p.requires_grad:
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        grads.append(p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad)
    return grads


def replica_step(trainer: Trainer, mine: list[Any], count: Any, step: int) -> tuple[float, float, bool]:
    """One attempt at step ``step`` (1-based) on this rank's share ``mine``; returns
    ``(global loss, grad norm, committed)``."""
    loss_sum, sums, _ = run_microbatches(trainer, mine, train=True, count=count)
    trainer.step_metrics = trainer.objective.metrics(sums, count) if sums else {}
    if trainer.dp_group is not None:
        dist.all_reduce(loss_sum, group=trainer.dp_group)  # the group's part of the global loss
    trainer.ft.reduce([*_local_grads(trainer), loss_sum.reshape(1)])  # + the other groups' parts
    grad_norm = clip_grad_norm_(trainer.model.parameters(), float(trainer.job.training.max_norm),
                                pp_group=trainer.pp_group)
    committed = trainer.ft.commit(step)
    trainer.apply_update(step, loss_sum, grad_norm, committed=committed)
    return float(loss_sum.item()), float(grad_norm.item()), committed


def replica_loop(trainer: Trainer, step: int, report: RunReport, profiler: StepProfiler) -> tuple[int, dict]:
    """Steps until ``training.steps`` is committed; returns the last step and its metrics."""
    ft: ReplicaSession = trainer.ft
    ft.resume_at(step)
    per_step = trainer.accum * trainer.dims.dp_size * ft.groups  # microbatches of the global batch
    metrics: dict[str, float] = {}
    data, held = iter(trainer.dataloader), None  # held: (step, the global batch) until it commits
    while True:
        t0 = time.perf_counter()
        step, healed = ft.begin_step()  # a restarted group jumps to the live groups' step here
        if healed is not None:
            data, held = iter(trainer.dataloader), None
        if step >= trainer.steps:
            break
        if held is None or held[0] != step:
            trainer.data_position = trainer.dataloader.state_dict()
            held = (step, [next(data) for _ in range(per_step)])
        participant, participants = ft.participant
        mine = share(held[1], participant, participants, trainer.dims.dp_rank(), trainer.dims.dp_size)
        lr = float(trainer.schedulers[0].get_last_lr()[0])
        loss, grad_norm, committed = replica_step(trainer, mine, batch_count(trainer, held[1]), step + 1)
        if not committed:
            continue  # the same rows again under the next quorum
        step += 1
        tokens = sum(b[0].numel() for b in held[1])
        held = None
        trainer.data_position = trainer.dataloader.state_dict()
        metrics = trainer.end_step(step, tokens, time.perf_counter() - t0, lr, loss, grad_norm, report, profiler,
                                   extra={"ft/replicas": float(participants)})
    ft.finish()
    return step, metrics

