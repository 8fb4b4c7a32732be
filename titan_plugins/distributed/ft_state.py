"""What a replica group hands a healing peer (torchft's checkpoint transport): this
rank's local shards of the model, its optimizer and lr-schedule state, the data
position and the step.

Rank i of every replica group holds the same shard layout, so plain local tensors
travel (a DTensor would drag its device mesh into the pickle); the receiver puts
them back into its own parameters and rebuilds the optimizer state as DTensors of
its parameters' layout.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["load_replica_state", "replica_state"]


def _local(t: Any) -> Any:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def replica_state(parts: list[torch.nn.Module], optimizers: list[torch.optim.Optimizer], schedulers: list[Any],
                  data: Any, step: int, replica: int) -> dict[str, Any]:
    """This rank's state, as local tensors (views: torchft serves them before the next
    optimizer step and blocks that step until the transfer is done)."""
    return {
        "model": [{k: _local(v) for k, v in part.state_dict().items()} for part in parts],
        "optim": [{"state": [{k: _local(v) for k, v in opt.state.get(p, {}).items()} for p in _params(opt)],
                   "groups": [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]}
                  for opt in optimizers],
        "sched": [s.state_dict() for s in schedulers],
        "data": data,
        "step": step,
        "replica": replica,
    }


def _like(local: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """``local`` on ``param``'s device (and as a DTensor of its layout where it has one)."""
    from torch.distributed.tensor import DTensor

    local = local.to(param.device)
    if isinstance(param, DTensor) and local.dim() > 0:
        return DTensor.from_local(local, param.device_mesh, param.placements, run_check=False,
                                  shape=param.shape, stride=param.stride())
    return local


@torch.no_grad()
def load_replica_state(state: dict[str, Any], parts: list[torch.nn.Module],
                       optimizers: list[torch.optim.Optimizer], schedulers: list[Any]) -> tuple[Any, int]:
    """Copy ``state`` (``replica_state`` of a peer) into this rank's objects; returns
    ``(data position, step)`` for the caller to apply."""
    for part, sent in zip(parts, state["model"], strict=True):
        for name, value in part.state_dict().items():
            _local(value).copy_(sent[name])
    for opt, sent in zip(optimizers, state["optim"], strict=True):
        for param, entry in zip(_params(opt), sent["state"], strict=True):
            opt.state[param] = {k: _like(v, param) if isinstance(v, torch.Tensor) else v
                                for k, v in entry.items()}
        for group, values in zip(opt.param_groups, sent["groups"], strict=True):
            group.update(values)
    for sched, sent in zip(schedulers, state["sched"], strict=True):
        sched.load_state_dict(sent)
    return state["data"], int(state["step"])
