"""What Slurm tells a process, read without calling Slurm (pure functions of the environment).

- :func:`where`: ``"step"`` inside an ``srun`` job step of several tasks (each task is a
  rank), ``"allocation"`` inside a job but not in such a step (an ``sbatch`` script without
  ``srun``, ``salloc``, ``srun -n 1``: titan-run starts its own ranks as on a workstation),
  ``None`` outside Slurm.
- :func:`rank_env`: ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``LOCAL_WORLD_SIZE``/``MASTER_ADDR``
  of a step's task. ``MASTER_ADDR`` is the step's first node (where task 0 runs with Slurm's
  block distribution), not the node ``srun`` was typed on. The port is not derived here:
  rank 0 picks a free one and publishes it in the run directory (``cli/run.py``).
- :func:`expand_hostlist`: ``gpu[01-03,07],login1`` -> ``gpu01 gpu02 gpu03 gpu07 login1``.
- :func:`step_name`: ``slurm-<job>.<step>``, the default run directory of a step.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

__all__ = ["expand_hostlist", "first_node", "rank_env", "step_name", "where"]

# SLURM_STEP_ID of the batch script (SLURM_BATCH_SCRIPT) and of the extern step; some
# Slurm versions export them by name.
_NOT_A_STEP = {"4294967294", "4294967295", "4294967293", "batch", "extern", "interactive"}


def _split_top(text: str) -> list[str]:
    """Split on commas outside brackets."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p for p in parts if p]


def _expand_one(name: str) -> list[str]:
    match = re.search(r"\[([^\[\]]*)\]", name)
    if match is None:
        return [name]
    head, tail = name[: match.start()], name[match.end():]
    out = []
    for item in match.group(1).split(","):
        lo, _, hi = item.partition("-")
        if hi:
            width = len(lo)
            numbers = [str(n).zfill(width) for n in range(int(lo), int(hi) + 1)]
        else:
            numbers = [lo]
        for number in numbers:
            out.extend(_expand_one(f"{head}{number}{tail}"))  # a later bracket, if any
    return out


def expand_hostlist(hostlist: str) -> list[str]:
    """Slurm's compressed host list (``SLURM_JOB_NODELIST``) as host names, in order."""
    hosts: list[str] = []
    for part in _split_top(hostlist.strip()):
        hosts.extend(_expand_one(part))
    return hosts


def first_node(env: Mapping[str, str] = os.environ) -> str | None:
    """The first node of this step (else of the job)."""
    for key in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"):
        if env.get(key):
            hosts = expand_hostlist(env[key])
            if hosts:
                return hosts[0]
    return None


def _tasks(env: Mapping[str, str]) -> int:
    return int(env.get("SLURM_STEP_NUM_TASKS") or env.get("SLURM_NTASKS") or 1)


def where(env: Mapping[str, str] = os.environ) -> str | None:
    if not env.get("SLURM_JOB_ID"):
        return None
    step = env.get("SLURM_STEP_ID")
    if step is None or step in _NOT_A_STEP or "SLURM_PROCID" not in env or _tasks(env) <= 1:
        return "allocation"
    return "step"


def _local_world(env: Mapping[str, str]) -> int:
    """Tasks on this node: ``SLURM_STEP_TASKS_PER_NODE`` (``2(x3),1``) at ``SLURM_NODEID``."""
    spec = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
    if not spec:
        return _tasks(env)
    counts: list[int] = []
    for part in spec.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if match:
            counts.extend([int(match.group(1))] * int(match.group(2) or 1))
    node = int(env.get("SLURM_NODEID", "0"))
    return counts[node] if node < len(counts) else _tasks(env)


def rank_env(env: Mapping[str, str] = os.environ) -> dict[str, str]:
    """torchrun's variables for a task of an ``srun`` step (``MASTER_PORT`` excepted)."""
    out = {
        "RANK": env["SLURM_PROCID"],
        "WORLD_SIZE": str(_tasks(env)),
        "LOCAL_RANK": env.get("SLURM_LOCALID", "0"),
        "LOCAL_WORLD_SIZE": str(_local_world(env)),
    }
    out["MASTER_ADDR"] = first_node(env) or env.get("SLURM_LAUNCH_NODE_IPADDR") or "localhost"
    return out


def step_name(env: Mapping[str, str] = os.environ) -> str:
    """``slurm-<job>.<step>``: one run directory per job step."""
    step = env.get("SLURM_STEP_ID")
    return f"slurm-{env['SLURM_JOB_ID']}.{step if step not in (None, *_NOT_A_STEP) else 'batch'}"
