"""Optional per-block ``torch.compile`` (``training.compile=true``).

Blocks are compiled in place with ``nn.Module.compile`` so parameter names (and
hence checkpoints) do not change.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

if TYPE_CHECKING:
    from omegaconf import DictConfig

__all__ = ["apply_compile"]


def apply_compile(model: nn.Module, job_config: DictConfig, *, layers_attr: str = "layers") -> None:
    """Compile each block of ``model.<layers_attr>`` when ``training.compile`` is set;
    repeated blocks share one compiled graph (same code, same shapes)."""
    if not bool(job_config.training.compile):
        return
    for block in getattr(model, layers_attr).values():
        block.compile(fullgraph=False)
