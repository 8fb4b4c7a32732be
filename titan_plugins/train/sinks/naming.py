"""Run names and flat params the tracker sinks share (their own module, so that the
sinks and the package that lists them do not import each other)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from omegaconf import DictConfig


def default_run_name(job: DictConfig, run_dir: str) -> str:
    """``<model>-<flavor>-<run dir name>``: tells runs apart in a tracker's list."""
    flavor = job.model.get("flavor") or "default"
    return f"{job.model.name}-{flavor}-{Path(run_dir).name}"


def flat_params(job: DictConfig) -> dict[str, Any]:
    """The resolved job as ``{"training.lr": 0.003, ...}`` (trackers take flat params)."""
    from omegaconf import OmegaConf

    out: dict[str, Any] = {}

    def walk(prefix: str, node: Any) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        else:
            out[prefix] = getattr(node, "value", node)  # Enum members as their value

    walk("", OmegaConf.to_container(job, resolve=True, enum_to_str=True))
    return out
