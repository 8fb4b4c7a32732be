"""Checkpoints with ``torch.distributed.checkpoint`` (DCP).

Layout: ``<folder>/step-<N>/`` per checkpoint. A save goes to ``step-<N>.tmp``; once
every rank has written, rank 0 writes ``manifest.json`` (every file and its size)
last, checks the files against it and renames the folder, so a crash during a save
leaves the previous checkpoint as the newest loadable one. A full disk ends the run
with one line, the partial save removed. On resume each candidate, newest first, is
checked against its manifest (and must load); a damaged one is skipped with a
one-line warning, and none usable is one error line. Keys are the models' own FQNs
(``torch.distributed.checkpoint.state_dict`` strips wrapper prefixes), so a
checkpoint loads under any other parallelism; non-persistent buffers are never in it.

Contents: ``model``, ``optimizer`` (flattened FQN keys), ``lr_scheduler``,
``dataloader`` (run-wide sample count), ``train_state`` (step), ``rng.rank<R>``.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from titan_plugins.errors import ConfigError, TitanError, os_errors_behind
from titan_plugins.model.optimizer import resync_lr
from titan_plugins.peft.checkpoint import checkpoint_filter
from titan_plugins.peft.lora import is_adapter_key
from titan_plugins.peft.qlora import load_base_from_dcp, pending_base

if TYPE_CHECKING:
    from omegaconf import DictConfig

__all__ = [
    "CheckpointError",
    "Checkpointer",
    "MANIFEST",
    "full_model_state_dict",
    "load_model_weights",
    "save_model_weights",
    "verify_checkpoint",
    "write_manifest",
]

MANIFEST = "manifest.json"
_STEP_DIR = re.compile(r"^step-(\d+)$")


class CheckpointError(TitanError):
    """A checkpoint could not be written or none could be read (one line, exit 2)."""


def _is_enospc(exc: BaseException) -> bool:
    """ENOSPC anywhere in ``exc``: its cause/context chain or DCP's per-rank failures."""
    return any(e.errno == errno.ENOSPC for e in os_errors_behind(exc))


def write_manifest(path: Path) -> dict[str, int]:
    """Record every file of the checkpoint folder ``path`` with its size, atomically,
    as the last file written; returns the files."""
    files = {str(p.relative_to(path)): p.stat().st_size for p in sorted(path.rglob("*"))
             if p.is_file() and p.name != MANIFEST}
    tmp = path / f".{MANIFEST}.tmp"
    with open(tmp, "w") as f:
        json.dump({"files": files}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path / MANIFEST)
    return files


def verify_checkpoint(path: Path) -> str | None:
    """``None`` when ``path`` holds every file its manifest lists at its size, else
    what is wrong (one phrase)."""
    try:
        files = json.loads((path / MANIFEST).read_text())["files"]
    except FileNotFoundError:  # saved before manifests: complete if renamed (loading checks the rest)
        return None if (path / ".metadata").is_file() else "no .metadata and no manifest.json"
    except (OSError, ValueError, KeyError, TypeError):
        return "manifest.json is damaged"
    if ".metadata" not in files:
        return "the manifest lists no .metadata"
    for name, size in files.items():
        try:
            actual = (path / name).stat().st_size
        except OSError:
            return f"{name} is missing"
        if actual != size:
            return f"{name} has {actual} of {size} bytes"
    return None
_FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def model_state_dict(parts: list[torch.nn.Module]) -> dict[str, Any]:
    sd: dict[str, Any] = {}
    for part in parts:
        sd.update(get_model_state_dict(part))
    return sd


def _checkpoint_keys(path: Path) -> set[str]:
    reader = dcp.FileSystemReader(str(path))
    return set(reader.read_metadata().state_dict_metadata)


def load_model_weights(parts: list[torch.nn.Module], path: str | os.PathLike) -> None:
    """Load only the model weights of a (seed or full) checkpoint into ``parts``."""
    path = Path(path)
    if not (path / ".metadata").is_file():
        raise ConfigError(f"checkpoint.init_from={path}: not a DCP checkpoint (no .metadata)")
    keys = _checkpoint_keys(path)
    # LoRA adapters come from it only if it has them (a base checkpoint has none)
    sd = {k: v for k, v in model_state_dict(parts).items() if f"model.{k}" in keys or not is_adapter_key(k)}
    missing = [k for k in sd if f"model.{k}" not in keys]
    if missing:
        raise ConfigError(f"checkpoint.init_from={path}: has no weights for {missing[0]} (and {len(missing) - 1} more)")
    waiting = {k for part in parts for k in pending_base(part)}  # QLoRA: quantized as read (peft/qlora.py)
    state = {"model": {k: v for k, v in sd.items() if k not in waiting}}
    dcp.load(state, checkpoint_id=str(path))
    for part in parts:
        set_model_state_dict(part, state["model"], options=StateDictOptions(strict=False))
    load_base_from_dcp(parts, path)


def save_model_weights(model: torch.nn.Module, path: str | os.PathLike) -> None:
    """Write ``{"model": state_dict}`` with DCP (the seed checkpoint), atomically."""
    path = Path(path)
    if path.exists() and not (path / ".metadata").is_file():  # replace only an earlier checkpoint
        raise ConfigError(f"{path}: exists and is not a DCP checkpoint; not replaced (move it away)")
    tmp = path.with_name(path.name + ".tmp")
    if _rank() == 0 and tmp.exists():
        shutil.rmtree(tmp)
    _barrier()
    dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=str(tmp))
    _barrier()
    if _rank() == 0:
        write_manifest(tmp)
        if path.exists():
            shutil.rmtree(path)
        os.replace(tmp, path)
    _barrier()


def full_model_state_dict(parts: list[torch.nn.Module], pp_group: Any | None) -> dict[str, torch.Tensor] | None:
    """Every parameter as a full CPU tensor, merged over pipeline stages; on the first
    rank of ``pp_group`` (global rank 0 included), ``None`` elsewhere."""
    local: dict[str, torch.Tensor] = {}
    for part in parts:
        sd = get_model_state_dict(part, options=StateDictOptions(full_state_dict=True))
        local.update({k: v.detach().cpu() for k, v in sd.items()})
    if pp_group is None:
        return local
    gathered: list[Any] = [None] * dist.get_world_size(pp_group)
    dst = dist.get_global_rank(pp_group, 0)
    dist.gather_object(local, gathered if dist.get_rank() == dst else None, dst=dst, group=pp_group)
    if dist.get_rank() != dst:
        return None
    merged: dict[str, torch.Tensor] = {}
    for part_sd in gathered:
        merged.update(part_sd)
    return merged


class Checkpointer:
    """Periodic save, keep-last-N, resume from the newest complete checkpoint."""

    def __init__(
        self,
        job: DictConfig,
        run_dir: str | os.PathLike,
        parts: list[torch.nn.Module],
        optimizers: list[torch.optim.Optimizer],
        schedulers: list[Any],
        dataloader: Any,
    ) -> None:
        cfg = job.checkpoint
        folder = Path(cfg.folder)
        self.folder = folder if folder.is_absolute() else Path(run_dir) / folder
        self.enabled = bool(cfg.enabled)
        self.interval = int(cfg.interval)
        self.keep_last = int(cfg.keep_last)
        self.resume = bool(cfg.resume)
        self.save_final = bool(cfg.save_final)
        self.parts, self.optimizers, self.schedulers, self.dataloader = parts, optimizers, schedulers, dataloader
        self.model_keys = checkpoint_filter(job)  # peft=lora: only the adapters (titan_plugins/peft)

    # ------------------------------------------------------------ state
    def _state(self, step: int) -> dict[str, Any]:
        optim: dict[str, Any] = {}
        for part, opt in zip(self.parts, self.optimizers):
            optim.update(get_optimizer_state_dict(part, opt, options=_FLAT))
        model = model_state_dict(self.parts)
        if self.model_keys is not None:
            model = {k: v for k, v in model.items() if self.model_keys(k)}
        state: dict[str, Any] = {
            "model": model,
            "optimizer": optim,
            # Every part's scheduler steps alike: one state serves any number of parts.
            "lr_scheduler": self.schedulers[0].state_dict(),
            "train_state": {"step": step},
            "rng": {f"rank{_rank()}": torch.get_rng_state()},
        }
        if self.dataloader is not None:
            state["dataloader"] = self.dataloader.state_dict()
        return state

    # ------------------------------------------------------------ paths
    def checkpoints(self) -> list[tuple[int, Path]]:
        if not self.folder.is_dir():
            return []
        found = []
        for entry in self.folder.iterdir():
            m = _STEP_DIR.match(entry.name)
            if m and (entry / ".metadata").is_file():
                found.append((int(m.group(1)), entry))
        return sorted(found)

    # ------------------------------------------------------------ save
    def should_save(self, step: int, last_step: int) -> bool:
        if not self.enabled:
            return False
        return (self.interval > 0 and step % self.interval == 0) or (self.save_final and step == last_step)

    def save(self, step: int) -> Path:
        final = self.folder / f"step-{step}"
        tmp = self.folder / f"step-{step}.tmp"
        if _rank() == 0:
            self.folder.mkdir(parents=True, exist_ok=True)
            if tmp.exists():
                shutil.rmtree(tmp)
        _barrier()
        try:
            dcp.save(self._state(step), checkpoint_id=str(tmp))
            _barrier()  # every rank has written its shard
            problem = [None]
            if _rank() == 0:
                write_manifest(tmp)  # last: the record of what a complete save holds
                problem = [verify_checkpoint(tmp)]
            if dist.is_available() and dist.is_initialized():
                dist.broadcast_object_list(problem, src=0)
            problem = problem[0]
        except (Exception, CheckpointException) as exc:  # DCP's is a BaseException
            shutil.rmtree(tmp, ignore_errors=True)  # the partial save (DCP fails on every rank alike)
            if _is_enospc(exc):
                raise CheckpointError(f"no space left writing checkpoint step-{step} to {self.folder}") from None
            raise
        if problem is not None:
            shutil.rmtree(tmp, ignore_errors=True)
            raise CheckpointError(f"checkpoint step-{step} in {self.folder} failed its check after writing: {problem}")
        if _rank() == 0:
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)  # atomic: the checkpoint appears complete or not at all
            self._prune()
        _barrier()
        return final

    def _prune(self) -> None:
        if self.keep_last <= 0:
            return
        for _, path in self.checkpoints()[: -self.keep_last]:
            shutil.rmtree(path, ignore_errors=True)
        for entry in self.folder.glob("step-*.tmp"):
            shutil.rmtree(entry, ignore_errors=True)

    # ------------------------------------------------------------ load
    def maybe_resume(self) -> int:
        """Load the newest checkpoint if resuming is on; returns its step (0 if none)."""
        if not (self.enabled and self.resume):
            return 0
        found = self.checkpoints()
        if not found:
            return 0
        skipped: list[str] = []
        for step, path in reversed(found):
            problem = verify_checkpoint(path)
            if problem is None:
                try:
                    self.load(path)
                except (Exception, CheckpointException) as exc:  # noqa: BLE001 - damage the sizes did not show
                    problem = f"does not load ({type(exc).__name__})"
            if problem is None:
                if _rank() == 0:
                    if skipped:
                        print(f"warning: skipped damaged checkpoint {'; '.join(skipped)}", flush=True)
                    print(f"resumed from checkpoint {path} (step {step})", flush=True)
                return step
            skipped.append(f"{path.name}: {problem}")
        raise CheckpointError(f"no usable checkpoint in {self.folder} ({'; '.join(skipped)}); "
                              "move them away or set checkpoint.resume=false")

    def load(self, path: Path) -> None:
        keys = _checkpoint_keys(path)
        state = self._state(0)
        rng_key = f"rank{_rank()}"
        if f"rng.{rng_key}" not in keys:  # saved under another world size
            del state["rng"]
        if "dataloader" in state and not any(k.startswith("dataloader") for k in keys):
            del state["dataloader"]
        dcp.load(state, checkpoint_id=str(path))
        for part in self.parts:
            set_model_state_dict(part, state["model"], options=StateDictOptions(strict=False))
        for part, opt in zip(self.parts, self.optimizers):
            set_optimizer_state_dict(part, opt, optim_state_dict=state["optimizer"], options=_FLAT)
        for sched in self.schedulers:
            sched.load_state_dict(state["lr_scheduler"])
            resync_lr(sched)  # this run's schedule (training.steps may differ from the saved run's)
        if "dataloader" in state and self.dataloader is not None:
            self.dataloader.load_state_dict(state["dataloader"])
        if "rng" in state:
            torch.set_rng_state(state["rng"][rng_key])
