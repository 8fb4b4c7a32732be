"""The entry point of one rank: read the resolved config with OmegaConf, load
the plugins, train. Hydra never runs here.

``entry`` is what the elastic launcher spawns: it records the first line of a
user error (``TitanError``) or a crash's traceback in the elastic error file and
exits quietly, so the launcher prints the first failing rank's error once.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

__all__ = ["entry", "load_job", "run_rank"]


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


def create_seed_checkpoint(spec: Any, job: DictConfig, run_dir: Path) -> Path:
    """Build on one rank, ``init_weights`` with the seed, save the model with DCP."""
    import torch

    from titan_plugins.train.checkpoint import save_model_weights
    from titan_plugins.train.lifecycle import build_meta_model

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
    import torch.distributed as dist

    from titan_plugins.plugins import get_plugin_manager
    from titan_plugins.train.metrics import register_sinks
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
    try:
        return Trainer(spec, job, pm, run_dir).train()
    except BaseException as exc:
        # Stamp the failure now: tearing the process group down below makes the
        # peers fail too (gloo "Read error", NCCL "remote process exited"), and
        # the launcher must name this rank as the first to fail, not them.
        _stamp(exc)
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


_STAMP = "_titan_failed_ns"


def _stamp(exc: BaseException) -> None:
    if getattr(exc, _STAMP, None) is None:
        try:
            setattr(exc, _STAMP, time.time_ns())
        except AttributeError:  # exceptions with __slots__ keep the time of recording
            pass


def _record(exc: BaseException, user: bool) -> None:
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    rank = os.environ.get("RANK", "0")
    first = (str(exc).strip().splitlines() or [""])[0]
    if user:
        message = first or type(exc).__name__
    else:
        tb = "".join(traceback.format_exception(exc)).rstrip()
        message = f"rank {rank} crashed: {type(exc).__name__}: {first}\n{tb}"
    data = {
        "message": {
            "message": message,
            "extraInfo": {
                "py_callstack": "".join(traceback.format_exception(exc)),
                "timestamp": str(int(time.time())),
                "titan_time_ns": getattr(exc, _STAMP, None) or time.time_ns(),
                "titan_user_error": user,
            },
        }
    }
    with open(path, "w") as f:
        json.dump(data, f)


def entry(config_path: str) -> None:
    """The spawned rank's function: train; on failure record the error and exit
    with 2 (user error) or 1 (crash) without printing a traceback of its own."""
    from titan_plugins.errors import TitanError

    try:
        run_rank(config_path)
    except TitanError as exc:
        _record(exc, user=True)
        sys.stdout.flush()
        raise SystemExit(exc.exit_code) from None
    except BaseException as exc:  # noqa: BLE001 - every crash is reported by the launcher
        if isinstance(exc, SystemExit) and not exc.code:
            raise
        _record(exc, user=False)
        sys.stdout.flush()
        raise SystemExit(1) from None
