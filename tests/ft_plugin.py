"""A test plugin for fault_tolerance=torchft, driven by environment variables:

- ``TITAN_TEST_FT_KILL=REPLICA:STEP[:START],...``: rank 0 of that replica group SIGKILLs
  itself right after it committed that step (in its first start, or in start START);
- ``TITAN_TEST_FT_KILL_FORWARD=REPLICA:CALL``: rank 0 of that group SIGKILLs itself in its
  CALL-th forward of its first start (inside a step, after the step's quorum formed);
- ``TITAN_TEST_FT_WAIT=REPLICA:STEP:OTHER``: that group parks after committing STEP until
  group OTHER has been restarted and asked for a quorum (so that it heals at step STEP + 1
  from a live peer however long its restart takes on a busy machine);
- ``TITAN_TEST_FT_SLOW=SECONDS``: every step that much longer (time for a test to act).
"""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path
from typing import Any

from titan_plugins.hookspecs import hookimpl

TITAN_PLUGINS_API = ">=1.0,<2"


def _start() -> str:
    return os.environ.get("TITAN_FT_START", "0")


def _marker(job_config: Any, replica: int) -> Path:
    return Path(job_config.run_dir).parent / f"restarted-{replica}"


@hookimpl
def titan_on_train_start(job_config: Any, run_dir: str, rank: int) -> None:
    if _start() != "0" and rank == 0:
        _marker(job_config, job_config.fault_tolerance.replica_id).touch()


@hookimpl
def titan_on_step_end(step: int, metrics: dict[str, float], job_config: Any, rank: int) -> None:
    slow = float(os.environ.get("TITAN_TEST_FT_SLOW", "0"))
    if slow:
        time.sleep(slow)
    replica = job_config.fault_tolerance.replica_id
    for target in filter(None, os.environ.get("TITAN_TEST_FT_KILL", "").split(",")):
        who, at, *when = target.split(":")
        if rank == 0 and int(who) == replica and int(at) == step and (when or ["0"])[0] == _start():
            os.kill(os.getpid(), signal.SIGKILL)
    wait = os.environ.get("TITAN_TEST_FT_WAIT")
    if wait:
        who, at, other = (int(x) for x in wait.split(":"))
        deadline = time.monotonic() + 120
        while who == replica and at == step and not _asked_for_quorum(job_config, other):
            assert time.monotonic() < deadline, "the killed group never came back"
            time.sleep(0.05)


def _asked_for_quorum(job_config: Any, replica: int) -> bool:
    """Group ``replica`` restarted and its new Manager asked the lighthouse for a quorum
    (the lighthouse's log names a second id for it): the next quorum holds it."""
    if not _marker(job_config, replica).exists():
        return False
    log = Path(job_config.run_dir).parent / "lighthouse.log"
    ids = re.findall(rf"Received quorum request for replica {replica}:([0-9a-f-]+)", log.read_text())
    return len(set(ids)) > 1


@hookimpl
def titan_after_parallelize(model: Any, parallel_dims: Any, job_config: Any) -> None:
    spec = os.environ.get("TITAN_TEST_FT_KILL_FORWARD")
    if not spec or _start() != "0":
        return None
    who, call = (int(x) for x in spec.split(":"))
    calls = [0]

    def kill(_module: Any, _inputs: Any) -> None:
        import torch.distributed as dist

        calls[0] += 1
        if calls[0] == call and dist.get_rank() == 0 and job_config.fault_tolerance.replica_id == who:
            os.kill(os.getpid(), signal.SIGKILL)

    model.register_forward_pre_hook(kill)
    return None
