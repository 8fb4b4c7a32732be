"""One rank's side of ``fault_tolerance=torchft``: a torchft Manager per rank, the
step's quorum, this rank's share of the global batch, the gradient sum across the
live replica groups, the commit, and the quorum log.

A step (``Trainer._ft_loop``): ``begin_step`` asks the lighthouse for the quorum (a
restarted group heals here from a live peer: model shards, optimizer, lr schedule,
data position, step); every rank reads the step's whole global batch and trains on
its ``share`` (participant p of k, data-parallel rank d of D inside the group); the
loss is normalized by the global batch's label count, so ``reduce`` SUMs the
gradients (not torchft's default average) and the update is the one an uninterrupted
run makes, whatever the quorum; ``commit`` says whether the optimizer may step. A
step that is not committed is trained again with the same rows and a new quorum.

torchft is imported only here, and only when ``fault_tolerance.enable`` is on.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from titan_plugins.errors import ConfigError

__all__ = ["QUORUM_LOG", "QUORUM_LOG_ENV", "START_ENV", "ReplicaSession", "check_fault_tolerance", "lighthouse_url",
           "reachable", "share"]

QUORUM_LOG = "ft_quorums.jsonl"
QUORUM_LOG_ENV = "TITAN_FT_QUORUM_LOG"  # where the supervisor reads the quorums (default: the run dir)
START_ENV = "TITAN_FT_START"  # 0: the job's first start of this group; n: its n-th restart
INSTALL = "pip install 'titan-plugins[ft]'"


# ------------------------------------------------------------------ before launch
def lighthouse_url(address: str) -> str:
    return address if "://" in address else f"http://{address}"


def reachable(address: str, timeout: float = 2.0) -> bool:
    host, _, port = address.split("://")[-1].rstrip("/").rpartition(":")
    try:
        with socket.create_connection((host.strip("[]") or "localhost", int(port)), timeout=timeout):
            return True
    except (OSError, ValueError):
        return False


def check_fault_tolerance(job: Any, dims: Any) -> None:
    """The refusals of ``fault_tolerance=torchft``, one line each, before any rank starts."""
    ft = job.fault_tolerance
    if not ft.enable:
        return
    import importlib.util

    if importlib.util.find_spec("torchft") is None:
        raise ConfigError(f"fault_tolerance=torchft needs torchft, which is not installed: {INSTALL}")
    if ft.min_replicas > ft.replica_groups:
        raise ConfigError(f"fault_tolerance.min_replicas={ft.min_replicas} is more than "
                          f"fault_tolerance.replica_groups={ft.replica_groups}: no step could ever commit")
    if ft.group_size is not None and ft.group_size != dims.world_size:
        raise ConfigError(f"fault_tolerance.group_size={ft.group_size} but parallelism={job.parallelism.get('name', '')} "
                          f"lays out {dims.world_size} ranks per group")
    for key, value, why in (
        ("parallelism.dp_replicate", dims.dp_replicate, "the replica groups are the replicate dimension"),
        ("parallelism.pp", dims.pp, "pipeline stages inside a replica group are not supported yet"),
        ("parallelism.cp", dims.cp, "context parallelism inside a replica group is not supported yet"),
    ):
        if value > 1:
            raise ConfigError(f"fault_tolerance=torchft with {key}={value}: {why}")
    objective = job.objective.name
    if objective != "sft":
        raise ConfigError(f"fault_tolerance=torchft with objective={objective}: only objective=sft is supported yet")
    method = job.peft.get("method") if job.get("peft") is not None else None
    method = str(getattr(method, "value", method))
    if method not in ("none", "None"):
        raise ConfigError(f"fault_tolerance=torchft with peft={method}: not supported yet")
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ and (not ft.lighthouse or ft.replica_id is None):
        raise ConfigError("fault_tolerance=torchft under torchrun or srun: each replica group is its own job; "
                          "give every group fault_tolerance.lighthouse=HOST:PORT and its fault_tolerance.replica_id")
    if ft.lighthouse and not reachable(ft.lighthouse):
        raise ConfigError(f"fault_tolerance.lighthouse={ft.lighthouse}: no lighthouse answers there "
                          "(start one with torchft_lighthouse, or leave it null for titan-run to start one)")


# ------------------------------------------------------------------ the data
def share(items: Sequence[Any], participant: int, participants: int, dp_rank: int, dp_size: int) -> list[Any]:
    """This rank's contiguous part of the step's microbatches: data rank
    ``participant * dp_size + dp_rank`` of ``participants * dp_size``. Every row of
    the global batch is trained exactly once, whatever the quorum."""
    ranks = participants * dp_size
    me = participant * dp_size + dp_rank
    n = len(items)
    return list(items[me * n // ranks:(me + 1) * n // ranks])


# ------------------------------------------------------------------ the session
class _RecordingClient:
    """torchft's ManagerClient, keeping the last quorum's answer (its participants'
    replica ids and who heals whom) for the quorum log."""

    def __init__(self, client: Any) -> None:
        self._client, self.last = client, None

    def _quorum(self, **kwargs: Any) -> Any:
        self.last = self._client._quorum(**kwargs)
        return self.last

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)


def _replica_of(replica_id: str) -> int:
    return int(replica_id.split(":", 1)[0])


class ReplicaSession:
    """A torchft Manager for this rank of replica group ``replica``.

    ``state_fn()`` / ``load_fn(state)``: what a healing peer receives and how it is
    applied (``titan_plugins.distributed.ft_state``)."""

    def __init__(self, ft: Any, *, group_rank: int, group_world: int, device: torch.device, run_dir: str,
                 state_fn: Callable[[], Any], load_fn: Callable[[Any], None]) -> None:
        from torchft import Manager
        from torchft.process_group import ProcessGroupBabyNCCL, ProcessGroupGloo

        self.replica = int(ft.replica_id or 0)
        self.groups = int(ft.replica_groups)
        self.group_rank = group_rank
        self.healed_from: int | None = None
        timeout = timedelta(seconds=float(ft.timeout_s))
        pg = ProcessGroupBabyNCCL(timeout=timeout) if device.type == "cuda" else ProcessGroupGloo(timeout=timeout)

        def load(state: Any) -> None:
            self.healed_from = int(state["replica"])
            load_fn(state)

        self.manager = Manager(
            pg=pg, load_state_dict=load, state_dict=state_fn, min_replica_size=int(ft.min_replicas),
            use_async_quorum=False, timeout=timeout, quorum_timeout=timedelta(seconds=float(ft.quorum_timeout_s)),
            connect_timeout=timeout, rank=group_rank, world_size=group_world, replica_id=str(self.replica),
            lighthouse_addr=lighthouse_url(ft.lighthouse), hostname=socket.gethostname(),
            init_sync=False,  # every group builds the same weights from training.seed
        )
        self.manager._client = self.client = _RecordingClient(self.manager._client)
        log = os.environ.get(QUORUM_LOG_ENV) or str(Path(run_dir) / QUORUM_LOG)
        self.log_path = log if group_rank == 0 else None
        self._attempt_started = 0.0
        # The job's first quorum waits for every group (a fast one would otherwise train
        # alone from step 0 while the others still start); a restarted group waits for one
        # live peer to heal from (alone it would train from its own step 0 again).
        first = os.environ.get(START_ENV, "0") == "0"
        self._need = self.groups if first else min(2, self.groups)
        self._need_tries = int(float(ft.quorum_timeout_s) / 0.1)

    def resume_at(self, step: int) -> None:
        """A group resumed from its own checkpoint at ``step``: the quorum heals the
        groups that are behind from the one furthest on."""
        self.manager.load_state_dict({"step": step, "batches_committed": 0})

    def begin_step(self) -> tuple[int, int | None]:
        """The quorum of the next step; returns ``(steps done, replica healed from or None)``."""
        self.healed_from = None
        self._attempt_started = time.time()
        self.manager.start_quorum()
        tries = 0  # every rank of the group sees the same quorums: they loop alike
        while self.manager.num_participants() < self._need:
            if tries >= self._need_tries:
                raise RuntimeError(f"replica group {self.replica} found {self.manager.num_participants()} of the "
                                   f"{self._need} groups it waits for within fault_tolerance.quorum_timeout_s")
            time.sleep(0.1)
            tries += 1
            self.manager.start_quorum()
        self._need = 0
        step = self.manager.current_step()
        if self.healed_from is not None:
            self._write({"event": "healed", "step": step + 1, "replica": self.replica, "from": self.healed_from,
                         "time": round(time.time(), 3)})
        return step, self.healed_from

    @property
    def participant(self) -> tuple[int, int]:
        """``(this group's place among the participants, how many participate)``."""
        rank = self.manager.participating_rank()
        return (0 if rank is None else int(rank)), max(1, self.manager.num_participants())

    def replicas(self) -> list[int]:
        last = self.client.last
        return sorted(_replica_of(r) for r in last.replica_ids) if last is not None else [self.replica]

    def reduce(self, tensors: list[torch.Tensor]) -> None:
        """SUM ``tensors`` in place over the live groups, in one flat all-reduce per dtype
        (rank i of every group holds the same shapes)."""
        from torch.distributed import ReduceOp

        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for t in tensors:
            by_dtype.setdefault(t.dtype, []).append(t)
        for group in by_dtype.values():
            flat = torch.cat([t.reshape(-1) for t in group])
            self.manager.allreduce(flat, reduce_op=ReduceOp.SUM).wait()
            offset = 0
            for t in group:
                t.copy_(flat[offset:offset + t.numel()].view_as(t))
                offset += t.numel()

    def commit(self, step: int) -> bool:
        """Whether the optimizer may step (every live group agrees); logs the attempt of
        step ``step`` (1-based)."""
        ok = bool(self.manager.should_commit())
        self._log(step, ok)
        return ok

    def _log(self, step: int, committed: bool) -> None:
        if self.log_path is None:
            return
        _, k = self.participant
        self._write({"step": step, "replica": self.replica, "participants": k, "of": self.groups,
                     "replicas": self.replicas(), "committed": committed, "quorum_id": self.manager._quorum_id,
                     "started": round(self._attempt_started, 3), "time": round(time.time(), 3)})

    def _write(self, record: dict[str, Any]) -> None:
        if self.log_path is None:
            return
        line = (json.dumps(record) + "\n").encode()
        fd = os.open(self.log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line)  # one small append: the groups share the file
        finally:
            os.close(fd)

    def finish(self) -> None:
        """After the last quorum: one more commit round (it waits until a peer that healed
        from this group has its state), then stop the Manager."""
        self.manager.should_commit()
        self.manager.shutdown(wait=False)
