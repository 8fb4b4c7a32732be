"""One rank of the kit's loss-parity job (``python -m
titan_plugins.testing.conformance._parity_ranks PLAN.json``, started twice by
``parity.py`` with RANK and WORLD_SIZE=2 set; rank 0 publishes its store's port in the
plan's folder, testing.gloo.rendezvous_store).

Several cases share one launch, so the interpreters, torch and the plugin import
once: rank 0 first writes each group's seed checkpoint and trains the one-rank
baseline in a process group of its own (world size 1); then both ranks join the
2-rank gloo group and train every case (``fsdp``, ``tp``, ``ep``) in turn with the
core's ``Trainer``, from the same seed checkpoint. Each result is a JSON line in
``results-rank<R>.jsonl``; a failure is recorded and ends the process at once,
so the launcher can stop the peer and start the cases that did not run.
"""

from __future__ import annotations

import json
import os
import sys
import time
import warnings
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from titan_plugins.hookspecs import hookimpl

if TYPE_CHECKING:
    from titan_plugins.plugins import TitanPluginManager


class _Losses:
    """A plugin collecting the global loss of every step (what metrics.jsonl holds)."""

    def __init__(self) -> None:
        self.values: list[float] = []

    @hookimpl
    def titan_on_step_end(self, metrics: dict[str, float]) -> None:
        self.values.append(float(metrics["loss"]))


def _record(out: Any, **fields: Any) -> None:
    out.write(json.dumps({**fields, "time": time.time()}) + "\n")
    out.flush()


def _train(pm: TitanPluginManager, losses: _Losses, config_path: str) -> list[float]:
    from titan_plugins.train.trainer import Trainer
    from titan_plugins.train.worker import load_job

    job = load_job(config_path)
    losses.values = []
    Trainer(pm.get_model(job.model.name), job, pm, job.run_dir).train()
    return list(losses.values)


def _seed(pm: TitanPluginManager, config_path: str) -> list[float]:
    from titan_plugins.train.worker import create_seed_checkpoint, load_job

    job = load_job(config_path)
    create_seed_checkpoint(pm.get_model(job.model.name), job, Path(job.run_dir))
    return []


def _alone(fn: Callable[[], list[float]]) -> list[float]:
    """Run ``fn`` as the only rank of a world of one (the baseline and the seed)."""
    import torch.distributed as dist

    from titan_plugins.distributed.teardown import destroy_process_groups

    saved = os.environ["WORLD_SIZE"]
    os.environ["WORLD_SIZE"] = "1"
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        return fn()
    finally:
        destroy_process_groups(synchronize=True)
        os.environ["WORLD_SIZE"] = saved


def main(plan_path: str) -> int:
    import torch
    import torch.distributed as dist

    from titan_plugins.distributed.teardown import destroy_process_groups
    from titan_plugins.plugins import get_plugin_manager
    from titan_plugins.testing.conformance.contract import one_line, where

    plan = json.loads(Path(plan_path).read_text())
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit():
        torch.set_num_threads(int(threads))
    warnings.filterwarnings("ignore", message="DTensor random operators may not have complete support")
    pm = get_plugin_manager(strict=True)
    losses = _Losses()
    pm.register(losses, name="titan-kit-parity-losses")
    out = open(Path(plan["dir"]) / f"results-rank{rank}.jsonl", "a")  # noqa: SIM115 - open for the run

    def step(group: int, what: str, fn: Callable[[], list[float]]) -> None:
        try:
            values = fn()
        except BaseException as exc:  # noqa: BLE001 - recorded; the launcher reports it
            _record(out, group=group, what=what, rank=rank, error=f"{one_line(exc)}{where(exc)}")
            out.close()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)  # a peer waiting in a collective fails at once instead of hanging
        if rank == 0:
            _record(out, group=group, what=what, losses=values)

    if rank == 0:
        for index, group in enumerate(plan["groups"]):
            if group.get("seed"):
                step(index, "seed", lambda g=group: _alone(lambda: _seed(pm, g["seed"])))
            if group.get("base"):
                step(index, "base", lambda g=group: _alone(lambda: _train(pm, losses, g["base"])))
    cases = [(index, kind, path) for index, group in enumerate(plan["groups"]) for kind, path in group["cases"]]
    if cases:
        from titan_plugins.testing.gloo import rendezvous_store

        store = rendezvous_store(plan["dir"], rank, world, timeout=plan["timeout"])
        dist.init_process_group("gloo", rank=rank, world_size=world, store=store,
                                timeout=timedelta(seconds=plan["timeout"]))
        for index, kind, path in cases:
            step(index, kind, lambda p=path: _train(pm, losses, p))
        destroy_process_groups(synchronize=True)
    out.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
