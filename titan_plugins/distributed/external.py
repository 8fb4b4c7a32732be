"""One rank of a job that another launcher started: ``srun`` (each Slurm task a rank),
``torchrun``, a hydra-submitit-launcher job with several tasks.

Rank 0 claims the run directory (``run_dir.take``) before anything is written into it,
writes the resolved config, picks the rendezvous port when the launcher gave none (Slurm:
a free port on the step's first node, so that two steps or two jobs on one node never
share one) and publishes it in ``<run_dir>/.titan-rendezvous`` with the launch's token
(job, step, restart). The other ranks wait for that token, then read the same config.
Every rank trains; a failure is one ``error: rank N: ...`` line from that rank and a
non-zero exit (under ``srun --kill-on-bad-exit`` Slurm then stops the step's other
tasks); rank 0 writes ``result.json``, whatever happened.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from titan_plugins.errors import ConfigError, TitanError

__all__ = ["RENDEZVOUS_FILE", "TRAINER_STEPS", "RankSteps", "launch_token", "publish", "run_external_rank",
           "wait_published"]

RENDEZVOUS_FILE = ".titan-rendezvous"
FAILURES = ".titan-failures"  # the step's ranks' failure records (failures.py)
WAIT_ENV = "TITAN_RENDEZVOUS_TIMEOUT"  # seconds; read per call, never at import (train/zygote.py)
# The trainer, named not imported: distributed/ sits below train/ (docs/architecture.md).
TRAINER_STEPS = "titan_plugins.train.run_files:RANK_STEPS"


@dataclass(frozen=True)
class RankSteps:
    """What a rank does around the rendezvous: rank 0 writes the resolved config
    (``write_config(job, run_dir) -> config path``), every rank trains from it
    (``run_rank(config_path)``), rank 0 writes ``result.json`` (``write_result(run_dir, *,
    job, overrides, returncode, error)``)."""

    write_config: Callable[[Any, Path], Path]
    run_rank: Callable[[Path], object]
    write_result: Callable[..., object]


def launch_token(env=os.environ) -> str:
    """Names this launch: the same on every rank of it, another one for any other."""
    if env.get("SLURM_JOB_ID") and env.get("TITAN_LAUNCHED_BY") == "slurm":
        return (f"slurm {env['SLURM_JOB_ID']}.{env.get('SLURM_STEP_ID', 'batch')} "
                f"restart {env.get('SLURM_RESTART_COUNT', '0')}")
    return (f"torchrun {env.get('TORCHELASTIC_RUN_ID', 'none')} {env.get('MASTER_ADDR', '')}:"
            f"{env.get('MASTER_PORT', '')} restart {env.get('TORCHELASTIC_RESTART_COUNT', '0')}")


def publish(run_dir: str | os.PathLike, token: str, addr: str, port: str) -> None:
    path = Path(run_dir) / RENDEZVOUS_FILE
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"token": token, "addr": addr, "port": port}) + "\n")
    os.replace(tmp, path)


def wait_published(run_dir: str | os.PathLike, token: str, timeout: float | None = None) -> dict[str, str]:
    """What rank 0 published for ``token``; a ``ConfigError`` after ``timeout`` seconds
    (``TITAN_RENDEZVOUS_TIMEOUT``, 300 by default)."""
    if timeout is None:
        timeout = float(os.environ.get(WAIT_ENV, "300"))
    path = Path(run_dir) / RENDEZVOUS_FILE
    deadline = time.monotonic() + timeout
    while True:
        try:
            data = json.loads(path.read_text())
            if data.get("token") == token:
                return data
        except (OSError, ValueError):
            pass
        if time.monotonic() > deadline:
            raise ConfigError(
                f"rank 0 did not claim the run directory {run_dir} within {timeout:.0f} s "
                "(it failed, or the directory is not shared between the nodes)"
            )
        time.sleep(0.1)


def _ephemeral_low() -> int:
    """The low end of the OS's ephemeral port range (Linux default 32768)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _free_port() -> str:
    """A free port for the rendezvous store, below the ephemeral range. A port found by
    binding port 0 comes from that range, where any process's outgoing connection (the
    gloo peers of other jobs on the node) can take it before the store binds it: seen as
    EADDRINUSE on rank 0. Below the range only another listener can; the candidates are
    shuffled so that two steps starting together rarely try the same one."""
    import random
    import socket

    low = _ephemeral_low()
    candidates = list(range(max(1024, low - 12000), low))
    random.SystemRandom().shuffle(candidates)
    for port in [*candidates[:200], 0]:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("", port))  # every interface: the other nodes connect to the node's address
            except OSError:
                continue
            return str(s.getsockname()[1])
    raise TitanError("no free TCP port for the rendezvous store on this node")


def _first_record(folder: Path, rank: int) -> tuple[str | None, bool]:
    """The step's first recorded failure (its message) and whether it is ``rank``'s. A rank
    records its failure before its teardown wakes the peers, so the first record is the
    cause and later ones ("Connection closed by peer") are its fallout."""
    from titan_plugins.failures import read_failure_records

    records = read_failure_records(folder)
    if not records:
        return None, True

    def when(item):
        info = item[1].get("message", {}).get("extraInfo", {}) if isinstance(item[1].get("message"), dict) else {}
        return (int(info.get("titan_time_ns") or 0), item[0])

    first_rank, data = min(records.items(), key=when)
    msg = data.get("message")
    text = msg.get("message") if isinstance(msg, dict) else msg
    return (str(text) if text else None), first_rank == rank


def launch_info(env=os.environ) -> dict[str, Any]:
    """Which job (and step) a run belongs to, for ``result.json``."""
    info: dict[str, Any] = {"by": env.get("TITAN_LAUNCHED_BY", "titan-run")}
    if env.get("SLURM_JOB_ID"):
        info["slurm_job_id"] = env["SLURM_JOB_ID"]
        if env.get("SLURM_STEP_ID") is not None:
            info["slurm_step_id"] = env["SLURM_STEP_ID"]
        info["slurm_nodelist"] = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
    if env.get("TORCHELASTIC_RUN_ID") and info["by"] == "torchrun":
        info["torchrun_run_id"] = env["TORCHELASTIC_RUN_ID"]
    if info["by"] != "titan-run":
        info["master"] = f"{env.get('MASTER_ADDR', '')}:{env.get('MASTER_PORT', '')}"
        info["world_size"] = int(env.get("WORLD_SIZE", "1"))
    return info


def run_external_rank(job: Any, run_dir: Path, *, key: str, overrides: str, job_name: str,
                      plan: Callable[[], int] | None = None, steps: RankSteps | str = TRAINER_STEPS) -> int:
    """Train as this process's rank (``RANK``/``WORLD_SIZE``/``MASTER_ADDR`` set); returns
    the exit code. ``plan``: what rank 0 runs instead when ``plan=true``. ``steps``: the
    trainer's side (a ``RankSteps`` or a ``"module:attribute"`` naming one)."""
    from titan_plugins.failures import (
        FAILURE_DIR_ENV,
        clear_error_file,
        failure_line,
        record_failure,
        write_error_file,
    )
    from titan_plugins.run_dir import take
    from titan_plugins.spec import resolve

    rank_steps: RankSteps = resolve(steps)
    env = os.environ
    rank = int(env["RANK"])
    token = launch_token()
    failures = run_dir / FAILURES
    if rank == 0:
        take(run_dir, key)  # before config.yaml, error.txt, result.json: one line if it is live
        if plan is not None:
            return plan()
        config_path = rank_steps.write_config(job, run_dir)
        clear_error_file(run_dir)
        shutil.rmtree(failures, ignore_errors=True)  # an earlier launch's records
        failures.mkdir()
        env.setdefault("MASTER_PORT", _free_port())
        publish(run_dir, token, env["MASTER_ADDR"], env["MASTER_PORT"])
    else:
        if plan is not None:
            return 0
        env.setdefault("MASTER_PORT", wait_published(run_dir, token)["port"])
        config_path = run_dir / "config.yaml"
    env[FAILURE_DIR_ENV] = str(failures)  # every rank records its failure there
    code, error = 0, None
    terminating = _TerminateAsExit()
    try:
        rank_steps.run_rank(config_path)  # records a failure in FAILURE_DIR_ENV before its teardown
    except BaseException as exc:  # noqa: BLE001 - one report for the step, no traceback wall
        terminating.stop()  # a second SIGTERM must not cut the report short
        if isinstance(exc, SystemExit) and not exc.code:
            code = 0
        else:
            record_failure(exc)
            first, mine = _first_record(failures, rank)
            code = _exit_code(exc)
            error = first or f"rank {rank} crashed: {type(exc).__name__}: {exc}"
            if mine:  # the step's first failure is this rank's: its peers' errors are fallout
                print(failure_line(error), file=sys.stderr, flush=True)
            if rank == 0:
                write_error_file(run_dir, error)
    terminating.stop()
    if rank == 0:
        with contextlib.suppress(OSError):  # a full disk: the error line is printed already
            rank_steps.write_result(run_dir, job=job_name, overrides=overrides, returncode=code, error=error)
    return code


class _TerminateAsExit:
    """SIGTERM ends this rank through the ``except`` above instead of killing it where it
    stands: under ``srun --kill-on-bad-exit`` Slurm sends it to the step's other tasks
    when one fails, and rank 0 must still write ``result.json`` (the first failure's line,
    exit 143). Installed only where nothing else handles SIGTERM (the preemption handler,
    installed later by the trainer, replaces it); ``stop`` ignores SIGTERM from then on if
    this handler is still the one in place, so the report itself is never interrupted."""

    def __init__(self) -> None:
        import signal

        class Terminated(SystemExit):
            def __str__(self) -> str:
                return f"terminated by {signal.Signals(self.code - 128).name}"

        def handler(signum: int, _frame: object) -> None:
            raise Terminated(128 + signum)

        self._handler = handler
        self._installed = signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None)
        if self._installed:
            signal.signal(signal.SIGTERM, handler)

    def stop(self) -> None:
        import signal

        if self._installed and signal.getsignal(signal.SIGTERM) is self._handler:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)


def _exit_code(exc: BaseException) -> int:
    if isinstance(exc, KeyboardInterrupt):
        return 130
    if isinstance(exc, TitanError):
        return exc.exit_code
    if isinstance(exc, SystemExit) and isinstance(exc.code, int):
        return exc.code
    return 1
