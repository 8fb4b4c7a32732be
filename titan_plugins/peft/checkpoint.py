"""What a LoRA run checkpoints, and adapters loaded into a run.

With ``peft=lora`` (and ``peft.adapter_only_checkpoints``, the default) a checkpoint
holds the adapters, their optimizer state, the schedule, the data position and the
RNG: no frozen base weight. The base comes from ``model.hf`` or
``checkpoint.init_from`` at every start, before the resume, so a resume is bitwise.

(A LoRA run's checkpoint loaded into a fresh model, as titan-generate does, is
``run_weights.py``: it reads through ``checkpoint/checkpointer.py``, which imports this.)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from titan_plugins.peft.experts import GroupedLoRA
from titan_plugins.peft.folder import Shapes, read_peft_adapter
from titan_plugins.peft.lora import adapter_modules, is_adapter_key, lora_enabled, set_full

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from titan_plugins.spec import ModelSpec

__all__ = ["adapter_shapes", "checkpoint_filter", "load_adapter_folder"]


def checkpoint_filter(job: DictConfig) -> Callable[[str], bool] | None:
    """Which model state-dict keys a checkpoint keeps (``None``: all of them)."""
    if not lora_enabled(job) or not bool(job.peft.get("adapter_only_checkpoints", True)):
        return None
    return is_adapter_key


def adapter_shapes(spec: ModelSpec, job: DictConfig) -> Shapes:
    """Every adapted module of the run's model (built on meta): ``{name: (out, in)}``,
    grouped expert pairs ``{name: (experts, out, in)}``."""
    from titan_plugins.model.lifecycle import apply_peft, build_meta_model

    model = build_meta_model(spec, job)
    apply_peft(model, spec, job)
    return {name: m.shape if isinstance(m, GroupedLoRA) else (m.out_features, m.in_features)
            for name, m in adapter_modules(model)}


def load_adapter_folder(parts: list[torch.nn.Module], spec: ModelSpec, config: object, job: DictConfig) -> int:
    """``peft.init_from=DIR``: a PEFT adapter folder into the run's adapters (each rank
    copies its own shards); returns how many modules were filled."""
    shapes = adapter_shapes(spec, job)  # the whole model's (a pipeline stage holds some)
    full = read_peft_adapter(spec, config, job.peft, job.peft.init_from, shapes, job.model.get("hf"))
    filled = 0
    for part in parts:
        for name, module in adapter_modules(part):
            set_full(module.lora_A.weight, full[f"{name}.lora_A.weight"])
            set_full(module.lora_B.weight, full[f"{name}.lora_B.weight"])
            filled += 1
    return filled
