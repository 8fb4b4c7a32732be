"""Run one function on N local gloo ranks: the harness of tests that start their own
ranks without the trainer.

    def check(rank: int, world: int, n: int) -> list[float]:   # module level
        t = torch.full((n,), float(rank + 1))
        dist.all_reduce(t)
        return t.tolist()

    assert run_ranks(check, 2, 3) == [[3.0, 3.0, 3.0]] * 2

Each rank replaces its environment with the caller's, sets ``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT`` (rank 0's store port, assigned by the
OS and published in the call's folder: ``rendezvous_store``), joins a gloo process group, runs
``fn(rank, world, *args)`` and ends its groups as the trainer's ranks do
(``destroy_process_groups``). The values come back in rank order; a rank that raises
or dies ends the call with one :class:`RankFailure` naming the first failing rank with
its traceback, and the other ranks are killed.

Ranks fork from the warm process that launches jobs (``train.zygote``: it imported
torch, DTensor, DCP, the trainer and every installed plugin, transformers for
model=hf, once), else from ``multiprocessing``'s fork server, which imports torch and
``fn``'s module once (a spawned rank re-imports them: ~3-5 s of CPU each, the trainer
and the plugins as much again). Either outlives the call, so later calls in the same
process fork from it too, and a forked rank inherits the *server's* environment: hence
the caller's environment is handed over and installed first. ``fn`` must be a
module-level function whose module imports outside pytest (the ranks import it by
name, with the caller's ``sys.path``).

This module imports nothing heavy; torch loads on the first call.
"""

from __future__ import annotations

import importlib
import multiprocessing
import os
import pickle
import shutil
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import wait
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

__all__ = ["RankFailure", "rendezvous_store", "run_ranks"]


class RankFailure(AssertionError):
    """A rank raised, died, or the ranks outlived the timeout. ``rank``: the first
    rank that failed (``None`` on a timeout)."""

    def __init__(self, message: str, rank: int | None) -> None:
        super().__init__(message)
        self.rank = rank


def run_ranks(
    fn: Callable[..., Any],
    world: int,
    *args: Any,
    timeout: float = 300.0,
    threads: int = 1,
    start_method: str = "warm",
) -> list[Any]:
    """``[fn(0, world, *args), ..., fn(world - 1, world, *args)]``, each on its own
    gloo rank with ``threads`` torch threads; ``timeout`` (seconds) bounds the run.

    ``start_method``: ``"warm"`` (forked from ``train.zygote`` where it runs, else
    ``"forkserver"``), ``"forkserver"``, or ``"fork"``: forked from the caller itself,
    cheaper where they need what the caller has already loaded (a composed Hydra
    config), safe only while the caller runs no threads of its own (no process group)."""
    if "<" in fn.__qualname__:  # <lambda>, <locals>: the ranks could not import it
        raise ValueError(f"run_ranks needs a module-level function, got {fn.__qualname__}")
    out = tempfile.mkdtemp(prefix="titan-ranks-")
    env = dict(os.environ)  # now, not the fork server's (it may predate a monkeypatch)
    procs: list[Any] = []
    try:
        for rank in range(world):
            rank_args = ((fn.__module__, fn.__qualname__), rank, world, args, env, threads, out)
            proc = _start_warm(rank_args, out) if start_method == "warm" else None
            if proc is None:
                ctx = _context("forkserver" if start_method == "warm" else start_method, fn.__module__)
                proc = ctx.Process(target=_rank_main, args=rank_args, name=f"rank{rank}")
                proc.start()
            procs.append(proc)
        first_bad, timed_out = _wait(procs, timeout)
        _stop(procs)
        records = {rank: _load(out, rank) for rank in range(world)}
        if timed_out:
            raise RankFailure(_timeout_message(procs, records, timeout), None)
        missing = [r for r in range(world) if not records[r] or records[r][0] != "ok"]
        if first_bad is not None or missing:
            rank, text = _first_failure(procs, records, first_bad, missing)
            raise RankFailure(text, rank)
        return [records[rank][1] for rank in range(world)]
    finally:
        _stop(procs)
        shutil.rmtree(out, ignore_errors=True)


class _WarmRank:
    """A rank forked by the zygote, with what this module uses of ``Process``."""

    def __init__(self, child: Any) -> None:
        self.child, self.sentinel = child, child._conn

    @property
    def exitcode(self) -> int | None:
        return self.child.poll()

    def is_alive(self) -> bool:
        return self.child.poll() is None

    def join(self) -> None:
        self.child.wait()

    def kill(self) -> None:
        self.child.kill()


def _start_warm(rank_args: tuple, out: str) -> _WarmRank | None:
    """``python -m titan_plugins.testing.gloo ARGS`` forked from the zygote, with the
    caller's ``sys.path`` (the test folders that hold ``fn``'s module); None where no
    zygote serves."""
    from titan_plugins.train import zygote

    rank = rank_args[1]
    path = Path(out, f"args-{rank}.pkl")
    try:
        path.write_bytes(pickle.dumps(rank_args))
    except (pickle.PicklingError, TypeError, AttributeError):
        return None  # arguments only a multiprocessing pickler takes: the fork server's way
    paths = os.pathsep.join(p or os.getcwd() for p in sys.path)
    child = zygote.start([str(path)], env={**rank_args[4], "PYTHONPATH": paths},
                         stdout=1, stderr=2, module=__name__)
    return _WarmRank(child) if child is not None else None


def _context(method: str, module: str) -> multiprocessing.context.BaseContext:
    if method not in multiprocessing.get_all_start_methods():
        method = "spawn"
    ctx = multiprocessing.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(["torch", module])  # read only when the server starts
    return ctx


def _wait(procs: list[BaseProcess], timeout: float) -> tuple[int | None, bool]:
    """Until every rank has exited or one exited with an error: (the first rank seen
    to fail, or None; whether ``timeout`` passed first)."""
    deadline = time.monotonic() + timeout
    running = {proc.sentinel: rank for rank, proc in enumerate(procs)}
    while running:
        left = deadline - time.monotonic()
        if left <= 0:
            return None, True
        for sentinel in wait(list(running), left):
            rank = running.pop(sentinel)
            procs[rank].join()
            if procs[rank].exitcode != 0:
                return rank, False
    return None, False


def _stop(procs: list[BaseProcess]) -> None:
    for proc in procs:
        if proc.is_alive():
            proc.kill()
    for proc in procs:
        proc.join()


def _first_failure(
    procs: list[BaseProcess], records: dict[int, tuple | None], first_bad: int | None, missing: list[int]
) -> tuple[int, str]:
    """The failure to report: a rank that died without a word (a signal, a C++ abort)
    before anyone else failed, else the earliest recorded exception (its peers' later
    "Connection closed" errors are its fallout), else a rank that left no result."""
    errors = {r: rec for r, rec in records.items() if rec and rec[0] == "error"}
    if first_bad is not None and first_bad not in errors:
        rank, text = first_bad, _exit_text(first_bad, procs[first_bad].exitcode)
    elif errors:
        rank = min(errors, key=lambda r: errors[r][1])
        text = f"rank {rank} failed:\n{errors[rank][2]}"
    else:
        rank = missing[0]
        text = _exit_text(rank, procs[rank].exitcode)
    others = sorted(set(errors) - {rank})
    if others:
        text += f"\n(ranks {others} failed after it)"
    return rank, text


def _exit_text(rank: int, code: int | None) -> str:
    if code is not None and code < 0:
        return f"rank {rank} was killed by signal {signal.Signals(-code).name} (its stderr may say why)"
    return f"rank {rank} exited with code {code} without a result (its stderr may say why)"


def _timeout_message(procs: list[BaseProcess], records: dict[int, tuple | None], timeout: float) -> str:
    hung = [r for r, rec in records.items() if rec is None]
    text = f"ranks did not finish within timeout={timeout:g} s; still running: ranks {hung}"
    for rank, rec in records.items():
        if rec and rec[0] == "error":
            text += f"\nrank {rank} failed:\n{rec[2]}"
    return text


# ------------------------------------------------------------------ in the rank
def _rank_main(
    target: tuple[str, str], rank: int, world: int, args: tuple, env: dict[str, str],
    threads: int, out: str,
) -> None:
    os.environ.clear()  # first: the fork server's environment is not the caller's
    os.environ.update(env)
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
    )
    import torch
    import torch.distributed as dist

    from titan_plugins.distributed.teardown import destroy_process_groups

    torch.set_num_threads(threads)
    finished = False
    try:
        module, qualname = target
        fn: Any = importlib.import_module(module)
        for name in qualname.split("."):
            fn = getattr(fn, name)
        store = rendezvous_store(out, rank, world)
        dist.init_process_group("gloo", rank=rank, world_size=world, store=store)
        _save(out, rank, ("ok", fn(rank, world, *args)))
        finished = True
    except BaseException:  # noqa: BLE001 - the parent raises it, with this traceback
        _save(out, rank, ("error", time.time_ns(), traceback.format_exc()))
    finally:
        destroy_process_groups(synchronize=finished)
    if not finished:
        sys.exit(1)


def rendezvous_store(folder: str | Path, rank: int, world: int, timeout: float = 120.0):
    """The ranks' TCPStore. Rank 0 listens on a port the OS assigns and publishes it in
    ``folder`` (a fresh one per launch); the others read it there. A port picked in advance and bound later could be
    taken meanwhile by any other process of a busy test run (seen in CI: EADDRINUSE)."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    path, wait_for = Path(folder, "rendezvous-port"), timedelta(seconds=timeout)
    if rank == 0:
        store = TCPStore("127.0.0.1", 0, world, is_master=True, timeout=wait_for, wait_for_workers=False)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(str(store.port))
        os.replace(tmp, path)
    else:
        deadline = time.monotonic() + timeout
        while not path.exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank 0 published no rendezvous port within {timeout:.0f} s")
            time.sleep(0.01)
        store = TCPStore("127.0.0.1", int(path.read_text()), world, is_master=False, timeout=wait_for)
    os.environ["MASTER_PORT"] = str(store.port)  # for code that reads it, as under torchrun
    return store


def _save(out: str, rank: int, record: tuple) -> None:
    # Atomic: the parent may kill this rank at any moment, then reads the file.
    path = Path(out, f"rank-{rank}.pkl")
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(pickle.dumps(record))
    os.replace(tmp, path)


def _load(out: str, rank: int) -> tuple | None:
    path = Path(out, f"rank-{rank}.pkl")
    return pickle.loads(path.read_bytes()) if path.is_file() else None


if __name__ == "__main__":  # a rank forked warm (_start_warm): its arguments in a file
    _rank_main(*pickle.loads(Path(sys.argv[1]).read_bytes()))
