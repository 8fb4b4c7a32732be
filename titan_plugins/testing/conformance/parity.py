"""The loss-parity contract: a short gloo run on 2 ranks (``fsdp``: dp_shard=2,
``tp``: tp=2, ``ep``: dp_shard=2 with ep=2) gives the one-rank loss at every step
within ``LOSS_PARITY``. Every run starts from one seed checkpoint (made once on one
rank, as ``titan-compare`` does) and sees the same global batch of 4 sequences.

Hydra composes and the core validates every run here, before any rank starts; the
runs then share one launched 2-rank job (``_parity_ranks``), so asking for several
cases costs one start of the ranks, not one per run; the ranks fork from the warm
process that launches jobs (``train.zygote``), which imported torch, the trainer and
the installed plugins once.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from titan_plugins.testing.conformance.contract import CheckResult, ContractError, one_line, tail
from titan_plugins.testing.conformance.session import Outcome, Session, open_session
from titan_plugins.testing.conformance.target import Target
from titan_plugins.train.zygote import popen_module

__all__ = ["PARITY_BASE", "PARITY_CASES", "TRAIN_OVERRIDES", "check_loss_parity", "launch_parity_ranks",
           "run_parity_checks"]

# kind -> the 2-rank run (same global batch of 4 as the baseline).
PARITY_CASES: dict[str, tuple[str, ...]] = {
    "fsdp": ("parallelism=fsdp2", "training.local_batch_size=2"),
    "tp": ("parallelism=tp2", "training.local_batch_size=4"),
    "ep": ("parallelism=fsdp2_ep2", "training.local_batch_size=2"),
    # the sequence split in 2 load-balanced halves: the 4 rows whole on each rank
    "cp": ("parallelism=cp2", "training.local_batch_size=4"),
}
PARITY_BASE = ("parallelism=single", "training.local_batch_size=4")
TRAIN_OVERRIDES = ("training.steps=3", "training.seq_len=32", "training.warmup_steps=1",
                   "training.deterministic=true", "metrics.tensorboard=false", "metrics.console=false")
_FIX = ("a parallelism must not change the math: check the TP plan's layouts (row-wise outputs, norms under "
        "sequence parallel, replicated modules wrapped), the expert-parallel dispatch (apply_moe_parallel_to_blocks), "
        "under cp the attention through components.attention.attend and the rotary table through "
        "cp_attention.rope_rows (global positions), that nothing depends on the local batch or sequence size, "
        "and compare the runs with `titan-compare`")


@dataclass
class _Group:
    """Runs that share the model overrides: one seed, one baseline, the 2-rank cases."""

    label: str
    overrides: list[str]
    kinds: list[str] = field(default_factory=list)
    seed: Path | None = None  # the seed checkpoint
    configs: dict[str, Path] = field(default_factory=dict)  # "seed", "base", kind -> config.yaml
    argv: dict[str, list[str]] = field(default_factory=dict)  # the same runs as titan-run overrides
    losses: dict[str, list[float]] = field(default_factory=dict)  # the runs done
    failed: dict[str, ContractError] = field(default_factory=dict)  # the runs that failed

    def pending(self) -> list[str]:
        """The runs still to do: none once the seed or the baseline failed, or no case is left."""
        if "seed" in self.failed or "base" in self.failed:
            return []
        todo = [k for k in self.configs if k not in self.losses and k not in self.failed]
        return todo if any(k in PARITY_CASES for k in todo) else []


def _key(kind: str, train_overrides: Sequence[str]) -> str:
    return f"loss-parity-{kind}:{' '.join(train_overrides)}"


def run_parity_checks(
    target: Target | Session, kinds: Sequence[str] = tuple(PARITY_CASES), *,
    run_dir: str | os.PathLike | None = None, train_overrides: Sequence[str] = TRAIN_OVERRIDES,
    timeout: float = 300.0,
) -> dict[str, Outcome]:
    """The loss-parity cases ``kinds`` in one launched 2-rank job: ``kind -> None``
    (holds), a skip reason, or the ``ContractError``. A session keeps the outcomes."""
    session = open_session(target)
    train_overrides = tuple(train_overrides)
    todo = [k for k in dict.fromkeys(kinds) if _key(k, train_overrides) not in session.outcomes]
    results: dict[str, Outcome] = {}
    groups: dict[str, _Group] = {}
    for kind in todo:
        if kind not in PARITY_CASES:
            raise ValueError(f"unknown parity case {kind!r} (have: {', '.join(PARITY_CASES)})")
        if not getattr(session.spec.capabilities, kind):
            results[kind] = f"model {session.target.model!r} does not declare {kind}"
            continue
        # ep runs on the EP overrides (a flavor with experts), baseline included.
        model = session.target.for_kind(kind) if kind == "ep" else session.target
        label = "" if model is session.target else f"-{kind}"
        group = groups.setdefault(label, _Group(label, [f"model={model.model}", *model.overrides, *train_overrides]))
        group.kinds.append(kind)
    if groups:
        if run_dir is None and session.workdir is None:
            session.workdir = tempfile.mkdtemp(prefix="titan-kit-")
        base_dir = Path(run_dir or session.workdir)
        results.update(_run_groups(session, list(groups.values()), base_dir, timeout))
    session.outcomes.update({_key(k, train_overrides): v for k, v in results.items()})
    return {k: session.outcomes[_key(k, train_overrides)] for k in kinds}


def check_loss_parity(
    target: Target | Session, kind: str = "fsdp", *, run_dir: str | os.PathLike | None = None,
    train_overrides: Sequence[str] = TRAIN_OVERRIDES, timeout: float = 300.0, together: Sequence[str] = (),
) -> CheckResult:
    """A short gloo run at 2 ranks (``fsdp``, ``tp``, ``ep`` or ``cp``) gives the single-rank
    loss at every step within ``LOSS_PARITY``. ``together`` names other cases to run
    in the same launched job (their outcomes stay in the session for later calls)."""
    outcome = run_parity_checks(target, (kind, *together), run_dir=run_dir, train_overrides=train_overrides,
                                timeout=timeout)[kind]
    if isinstance(outcome, ContractError):
        raise outcome
    return outcome


# ------------------------------------------------------------------ preparing
def _prepare(session: Session, group: _Group, name: str, extra: Sequence[str], base_dir: Path) -> None:
    """Compose and validate one run (``ConfigError`` before any rank starts) and write
    its resolved config; runs after the seed start from it."""
    from titan_plugins.train.api import prepare_job, write_config

    argv = [*group.overrides, *extra]
    run_dir = base_dir / f"{name}{group.label}" if name in ("seed", "single") else base_dir / name
    try:
        _, job, _ = prepare_job(argv, session.pm, run_dir=run_dir)
    except Exception as exc:
        raise ContractError("loss-parity", f"{' '.join(argv)} is rejected: {one_line(exc)}",
                            "make the model train under titan-run with these overrides") from None
    if name == "seed":
        folder = Path(job.checkpoint.folder)
        group.seed = (folder if folder.is_absolute() else run_dir / folder) / "seed"
    else:
        job.checkpoint.init_from = str(group.seed)  # written by the seed run before this one starts
        argv.append(f"checkpoint.init_from={group.seed}")
    key = "base" if name == "single" else name
    group.configs[key] = write_config(job, run_dir)
    group.argv[key] = argv


def _run_groups(session: Session, groups: list[_Group], base_dir: Path, timeout: float) -> dict[str, Outcome]:
    for group in groups:
        try:
            _prepare(session, group, "seed", ("parallelism=single", "checkpoint.create_seed=true"), base_dir)
            _prepare(session, group, "single", PARITY_BASE, base_dir)
        except ContractError as exc:
            group.failed["base"] = exc
            continue
        for kind in group.kinds:
            try:
                _prepare(session, group, kind, PARITY_CASES[kind], base_dir)
            except ContractError as exc:
                group.failed[kind] = exc
    attempt = 0
    while todo := [g for g in groups if g.pending()]:  # a failure ends a launch: the rest go into the next
        attempt += 1
        _launch(session, todo, base_dir, attempt, timeout)
    results: dict[str, Outcome] = {}
    for group in groups:
        broken = group.failed.get("seed") or group.failed.get("base")
        for kind in group.kinds:
            results[kind] = broken or group.failed.get(kind) or \
                _compare(kind, group.losses["base"], group.losses[kind])
    return results


# ------------------------------------------------------------------ launching
def launch_parity_ranks(plan_path: Path, work: Path, env: dict[str, str], logs: Sequence[Path], timeout: float, *,
                        progress: bool = False) -> tuple[list[dict], bool]:
    """Run the loss-parity ranks (``_parity_ranks``) of ``plan_path`` (whose ``dir`` is
    ``work``), one per log in ``logs``, with ``env`` (``MASTER_ADDR``, ``WORLD_SIZE``);
    wait until they end, one fails (its peer gets 2 s to record its own error) or
    ``timeout`` passes (with ``progress``: passes without a job finishing on rank 0).
    Returns every rank's result records and whether it timed out. Ranks fork warm
    where they can (``train.zygote``): no imports per rank."""
    results = [work / f"results-rank{rank}.jsonl" for rank in range(len(logs))]
    for path in results:
        path.unlink(missing_ok=True)  # the ranks append to it
    (work / "rendezvous-port").unlink(missing_ok=True)  # rank 0 publishes this launch's (rendezvous_store)
    procs = []
    for rank, log_path in enumerate(logs):
        with open(log_path, "w") as log:
            procs.append(popen_module("titan_plugins.testing.conformance._parity_ranks", [str(plan_path)],
                                      env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                                      stdout=log.fileno(), stderr=log.fileno()))
    finished, deadline, timed_out = 0, time.monotonic() + timeout, False
    try:
        while any(p.poll() is None for p in procs):
            if any(p.returncode not in (None, 0) for p in procs):
                time.sleep(2.0)  # let the peer record its own error, then stop it
                break
            done = len(results[0].read_text().splitlines()) if progress and results[0].is_file() else 0
            if done != finished:  # a job finished: the launch is making progress
                finished, deadline = done, time.monotonic() + timeout
            if time.monotonic() > deadline:
                timed_out = True
                break
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    records = [json.loads(line) for path in results if path.is_file()
               for line in path.read_text().splitlines() if line.strip()]
    return records, timed_out


def _launch(session: Session, todo: list[_Group], base_dir: Path, attempt: int, timeout: float) -> None:
    """One 2-rank job for the pending runs of ``todo``; records losses and failures."""
    plans = [(group, group.pending()) for group in todo]
    limit = timeout * sum(len(p) for _, p in plans)
    plan = {
        "dir": str(base_dir),
        "timeout": limit,
        "groups": [{"seed": str(g.configs["seed"]) if "seed" in p else None,
                    "base": str(g.configs["base"]) if "base" in p else None,
                    "cases": [[k, str(g.configs[k])] for k in p if k in PARITY_CASES]} for g, p in plans],
    }
    plan_path = base_dir / f"parity-plan-{attempt}.json"
    plan_path.write_text(json.dumps(plan))
    env = session.target.env()
    env.update(MASTER_ADDR="127.0.0.1", WORLD_SIZE="2")
    logs = [base_dir / f"parity-rank{r}-{attempt}.log" for r in range(2)]
    records, timed_out = launch_parity_ranks(plan_path, base_dir, env, logs, limit)
    for record in records:
        if "losses" in record:
            plans[record["group"]][0].losses[record["what"]] = record["losses"]
    errors = sorted((r for r in records if "error" in r), key=lambda r: r["time"])
    if errors:  # the earliest: a peer's later error is usually "connection closed"
        first = errors[0]
        group, what, rank, error = plans[first["group"]][0], first["what"], first["rank"], first["error"]
    else:
        missing = [(g, k) for g, p in plans for k in p if k not in g.losses]
        if not missing:
            return
        (group, what), rank = missing[0], 0
        error = f"timed out after {limit:g} s" if timed_out else \
            f"a rank ended without a result: {tail(logs[0].read_text() if logs[0].is_file() else '')}"
    group.failed[what] = ContractError(
        "loss-parity", f"titan-run {' '.join(group.argv[what])} failed (rank {rank}): {error}",
        f"run it yourself (run dir {group.configs[what].parent}) to see the whole error")


def _compare(kind: str, base: list[float], test: list[float]) -> Outcome:
    from titan_plugins.compare.tolerances import LOSS_PARITY

    tol = LOSS_PARITY
    for step, (b, t) in enumerate(zip(base, test), start=1):
        if not (math.isfinite(t) and tol.allows(b, t)):
            return ContractError(
                "loss-parity",
                f"step {step}: loss {t:.7f} under {kind} (2 ranks) vs {b:.7f} on one rank, same seed "
                f"checkpoint and global batch (tolerance rtol={tol.rtol:g}, atol={tol.atol:g})", _FIX)
    if len(test) != len(base):
        return ContractError("loss-parity", f"the {kind} run logged {len(test)} steps, one rank {len(base)}",
                             "make every rank finish every step")
    return None
