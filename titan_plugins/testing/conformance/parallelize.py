"""Parallelize contracts on a fake process group (``fsdp``, ``tp``, ``ep``, ``pp``):
every applicable case runs in one subprocess (``titan_plugins.testing._probe``),
so no process group is left behind in the caller."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterable

from titan_plugins.testing.conformance.contract import (
    FIXES,
    CheckResult,
    ContractError,
    last_json,
    tail,
)
from titan_plugins.testing.conformance.session import Outcome, Session, open_session
from titan_plugins.testing.conformance.target import Target

__all__ = ["KINDS", "PARALLELISMS", "check_parallelize", "parallelize_configs", "run_parallelize_checks"]

KINDS = ("fsdp", "tp", "ep", "pp")

# The degrees each fake-process-group check uses (world size = their product).
PARALLELISMS: dict[str, dict[str, int]] = {
    "fsdp": {"dp_shard": 2},
    "tp": {"tp": 2},
    "ep": {"dp_shard": 2, "ep": 2},
    "pp": {"pp": 2},  # plus tp=2 and dp_shard=2 when the model declares them
}


def parallelize_configs(target: Target | Session) -> dict[str, dict[str, int] | str]:
    """Which fake-process-group configurations apply: ``kind -> degrees`` or a skip reason."""
    session = open_session(target)
    caps = session.spec.capabilities
    out: dict[str, dict[str, int] | str] = {}
    for kind in KINDS:
        if not getattr(caps, kind):
            out[kind] = f"model {session.target.model!r} does not declare {kind} (Capabilities({kind}=False))"
            continue
        degrees = dict(PARALLELISMS[kind])
        if kind == "pp":
            if caps.tp:
                degrees["tp"] = 2
            if caps.fsdp:
                degrees["dp_shard"] = 2
        out[kind] = degrees
    return out


def run_parallelize_checks(
    target: Target | Session, *, kinds: Iterable[str] = KINDS, timeout: float = 300.0
) -> dict[str, Outcome]:
    """The parallelize checks of ``kinds`` in one subprocess on a fake process group:
    ``kind -> None`` (holds), a skip reason, or the ``ContractError``. A session keeps
    the outcomes, so a later call for a kind already run costs nothing."""
    session = open_session(target)
    kinds = tuple(kinds)
    todo = [k for k in kinds if f"parallelize-{k}" not in session.outcomes]
    configs = {k: v for k, v in parallelize_configs(session).items() if k in todo}
    run = {k: v for k, v in configs.items() if isinstance(v, dict)}
    results: dict[str, Outcome] = {k: v for k, v in configs.items() if isinstance(v, str)}
    if run:
        proc = subprocess.run(
            [sys.executable, "-m", "titan_plugins.testing._probe", "parallelize", session.target.as_json(),
             json.dumps(run)],
            capture_output=True, text=True, env=session.target.env(), timeout=timeout,
        )
        data = last_json(proc) or {}
        for kind in run:
            item = data.get(kind)
            if item is None:
                results[kind] = ContractError(
                    f"parallelize-{kind}", f"the fake-process-group check crashed: {tail(proc.stderr)}",
                    FIXES[f"parallelize-{kind}"])
            elif item.get("ok"):
                results[kind] = None
            else:
                results[kind] = ContractError(item["contract"], item["problem"], item["fix"])
    session.outcomes.update({f"parallelize-{k}": v for k, v in results.items()})
    return {k: session.outcomes[f"parallelize-{k}"] for k in kinds}


def check_parallelize(target: Target | Session, kind: str) -> CheckResult:
    """The parallelize hook under ``kind`` (``fsdp``, ``tp``, ``ep``, ``pp``) on a fake
    process group: it succeeds per stage, the plan resolves, the model is really
    sharded, buffers stay plain tensors and ``to_empty`` + ``init_weights`` work.
    On a ``Session`` the first call runs every kind in one subprocess; on a bare
    ``Target`` only ``kind`` runs."""
    session = open_session(target)
    kinds = KINDS if isinstance(target, Session) else (kind,)
    result = run_parallelize_checks(session, kinds=kinds)[kind]
    if isinstance(result, ContractError):
        raise result
    return result
