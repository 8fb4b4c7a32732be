"""The entry point of one rank: read the resolved config with OmegaConf, load
the plugins, train. Hydra never runs here.

``entry`` is what the elastic launcher spawns: it records the failure
(``titan_plugins.failures``: the first line of a user error, a crash's traceback)
and exits quietly, so the launcher prints the first failing rank's error once.

``python -m titan_plugins.train.worker CONFIG.yaml NPROC`` launches ``entry`` on
NPROC local ranks (``titan_plugins.train.api.run`` uses it to enforce timeouts).
"""

from __future__ import annotations

import logging
import os
import sys
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

from omegaconf import DictConfig, OmegaConf

from titan_plugins.failures import record_failure

if TYPE_CHECKING:
    from titan_plugins.spec import ModelSpec

__all__ = ["RANK_PRELOAD", "entry", "forwarded_signals", "load_job", "main", "rank_preload", "record_failure",
           "run_rank"]

# Imported once by the launcher's fork server for every rank (titan_plugins/train/preload.py).
RANK_PRELOAD = ("titan_plugins.train.preload",)


def rank_preload(spec: ModelSpec | None) -> tuple[str, ...]:
    """What the fork server imports for a job of ``spec``: the core's modules and the
    model's ``rank_imports`` (``transformers`` for model=hf)."""
    return (*RANK_PRELOAD, *(spec.rank_imports if spec is not None else ()))


def _job_spec(job: DictConfig) -> ModelSpec | None:
    """The job's model, if the plugins load here (a rank that cannot load them reports why)."""
    from titan_plugins.plugins import get_plugin_manager

    try:
        return get_plugin_manager().get_model(str(job.model.name))
    except Exception:  # noqa: BLE001 - see the docstring
        return None


def load_job(path: str | os.PathLike) -> DictConfig:
    """The resolved job: the YAML merged into the typed schema (enums become Enum
    members), ``model`` left a plain node."""
    from titan_plugins.config.schema import JobConfig

    return OmegaConf.merge(OmegaConf.structured(JobConfig), OmegaConf.load(path))


def _quiet_rank_logs() -> None:
    # DTensor warns on every step that a norm over two meshes (experts on ep x
    # expert_fsdp) takes two all-reduces: true, expected, and unreadable from 8 ranks.
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)


def _set_threads() -> None:
    import torch

    threads = os.environ.get("OMP_NUM_THREADS")
    if threads and threads.isdigit():
        torch.set_num_threads(int(threads))


def create_seed_checkpoint(spec: ModelSpec, job: DictConfig, run_dir: Path) -> Path:
    """Build on one rank, ``init_weights`` with the seed, save the model with DCP."""
    import torch

    from titan_plugins.checkpoint.checkpointer import save_model_weights
    from titan_plugins.model.lifecycle import build_meta_model

    model = build_meta_model(spec, job)
    model.to_empty(device="cpu")
    torch.manual_seed(int(job.training.seed))
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device("cpu"))
    folder = Path(job.checkpoint.folder)
    path = (folder if folder.is_absolute() else run_dir / folder) / "seed"
    save_model_weights(model, path)
    print(f"seed checkpoint written to {path}", flush=True)
    return path


def run_rank(config_path: str | os.PathLike) -> dict[str, float]:
    """Train as this process's rank (RANK/WORLD_SIZE/MASTER_* in the environment)."""
    from titan_plugins.distributed.teardown import destroy_process_groups
    from titan_plugins.plugins import get_plugin_manager
    from titan_plugins.train.metrics import register_sinks
    from titan_plugins.train.preemption import Preempted
    from titan_plugins.train.trainer import Trainer

    _set_threads()
    _quiet_rank_logs()
    # Init-time DTensor random ops on CPU meshes work; torch warns once per rank.
    warnings.filterwarnings("ignore", message="DTensor random operators may not have complete support")
    job = load_job(config_path)
    run_dir = Path(job.run_dir)
    pm = get_plugin_manager(strict=True)
    spec = pm.get_model(job.model.name)
    if job.checkpoint.create_seed:
        create_seed_checkpoint(spec, job, run_dir)
        return {}
    register_sinks(pm)
    finished = False
    try:
        result = Trainer(spec, job, pm, run_dir).train()
        finished = True
        return result
    except BaseException as exc:
        # Record the failure before the teardown below: it wakes the peers with
        # errors of their own (gloo "Connection closed by peer"), and once one of
        # them exits the agent may kill this rank before it could say why. The
        # launcher names the earliest record.
        record_failure(exc)
        finished = isinstance(exc, Preempted)  # every rank saved and stops after the same step
        raise
    finally:
        destroy_process_groups(synchronize=finished)


def entry(config_path: str) -> None:
    """The spawned rank's function: train; on failure record the error and exit
    with 2 (user error) or 1 (crash) without printing a traceback of its own."""
    from titan_plugins.errors import TitanError

    try:
        run_rank(config_path)
    except BaseException as exc:  # noqa: BLE001 - every crash is reported by the launcher
        if isinstance(exc, SystemExit) and not exc.code:
            raise
        record_failure(exc)  # a no-op when run_rank recorded it already
        sys.stdout.flush()
        if isinstance(exc, KeyboardInterrupt):
            raise SystemExit(130) from None
        raise SystemExit(exc.exit_code if isinstance(exc, TitanError) else 1) from None


def forwarded_signals(job: DictConfig) -> tuple:
    """What the launcher passes on to the ranks: ``checkpoint.on_signal`` (the ranks save
    and stop on it, ``titan_plugins.train.preemption``)."""
    from titan_plugins.train.preemption import signal_of

    sig = signal_of(job.checkpoint.get("on_signal"))
    return (sig,) if sig is not None else ()


def main(argv: list[str] | None = None) -> int:
    """``CONFIG.yaml NPROC``: launch ``entry`` on NPROC local ranks."""
    from titan_plugins.distributed.launcher import launch
    from titan_plugins.failures import ERROR_FILE

    argv = sys.argv[1:] if argv is None else argv
    from titan_plugins.errors import TitanError

    config_path, nproc = argv[0], int(argv[1])
    try:
        job = load_job(config_path)
        return launch(config_path, nproc, entry, error_file=Path(config_path).parent / ERROR_FILE,
                      preload=rank_preload(_job_spec(job)), forward=forwarded_signals(job))
    except TitanError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return exc.exit_code


if __name__ == "__main__":
    sys.exit(main())
