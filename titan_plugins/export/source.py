"""Where an export reads from: a run directory (its newest complete ``step-N``) or one
of its DCP checkpoints, and that checkpoint's model weights as full tensors in one
process (torch.distributed.checkpoint, no process group), whatever the parallelism it
was saved under."""

from __future__ import annotations

from pathlib import Path

import torch

from titan_plugins.errors import ConfigError

__all__ = ["find_checkpoint", "read_dcp_model"]

# A nested DCP state dict: tensors (and other values) under string keys.
NestedState = dict[str, "torch.Tensor | object | NestedState"]


def find_checkpoint(path: str | Path) -> tuple[Path, Path]:
    """``(run_dir, checkpoint dir)`` for a run directory (its newest ``step-N``) or
    a checkpoint directory inside one."""
    path = Path(path)
    if (path / ".metadata").is_file():
        run_dir = next((p for p in path.parents if (p / "config.yaml").is_file()), None)
        if run_dir is None:
            raise ConfigError(f"{path}: no config.yaml in the checkpoint's parent folders (not inside a run dir)")
        return run_dir, path
    if not (path / "config.yaml").is_file():
        raise ConfigError(f"{path}: neither a run directory (config.yaml) nor a DCP checkpoint (.metadata)")
    from omegaconf import OmegaConf

    job = OmegaConf.load(path / "config.yaml")
    folder = Path(job.checkpoint.folder)
    folder = folder if folder.is_absolute() else path / folder
    steps = sorted(
        (int(p.name.split("-")[1]), p) for p in folder.glob("step-*")
        if p.name.split("-")[1].isdigit() and (p / ".metadata").is_file()
    )
    if not steps:
        raise ConfigError(f"{path}: the run has no complete checkpoint under {folder}")
    return path, steps[-1][1]


def read_dcp_model(checkpoint: str | Path) -> dict[str, torch.Tensor]:
    """The ``model`` entries of a DCP checkpoint as full tensors, in this process."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    reader = dcp.FileSystemReader(str(checkpoint))
    keys = {k for k in reader.read_metadata().state_dict_metadata if k.startswith("model.")}
    if not keys:
        raise ConfigError(f"{checkpoint}: the checkpoint holds no model weights")
    state: NestedState = {}
    _load_state_dict(state, storage_reader=reader, planner=_EmptyStateDictLoadPlanner(keys=keys), no_dist=True)
    model = state["model"]
    return {k: v for k, v in _flatten(model).items() if isinstance(v, torch.Tensor)}


def _flatten(tree: object, prefix: str = "") -> dict[str, object]:
    if isinstance(tree, dict):
        out: dict[str, object] = {}
        for k, v in tree.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: tree}
