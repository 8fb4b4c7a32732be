"""What a LoRA run checkpoints, and adapters loaded into a run.

With ``peft=lora`` (and ``peft.adapter_only_checkpoints``, the default) a checkpoint
holds the adapters, their optimizer state, the schedule, the data position and the
RNG: no frozen base weight. The base comes from ``model.hf`` or
``checkpoint.init_from`` at every start, before the resume, so a resume is bitwise.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from titan_plugins.peft.lora import adapter_modules, is_adapter_key, lora_enabled, set_full

__all__ = ["checkpoint_filter", "load_adapter_folder", "load_lora_run_weights"]


def checkpoint_filter(job: Any) -> Callable[[str], bool] | None:
    """Which model state-dict keys a checkpoint keeps (``None``: all of them)."""
    if not lora_enabled(job) or not bool(job.peft.get("adapter_only_checkpoints", True)):
        return None
    return is_adapter_key


def load_adapter_folder(parts: list[torch.nn.Module], spec: Any, config: Any, job: Any) -> int:
    """``peft.init_from=DIR``: a PEFT adapter folder into the run's adapters (each rank
    copies its own shards); returns how many modules were filled."""
    from titan_plugins.peft.export import adapter_shapes, read_peft_adapter

    shapes = adapter_shapes(spec, job)  # the whole model's (a pipeline stage holds some)
    full = read_peft_adapter(spec, config, job.peft, job.peft.init_from, shapes, job.model.get("hf"))
    filled = 0
    for part in parts:
        for name, module in adapter_modules(part):
            set_full(module.lora_A.weight, full[f"{name}.lora_A.weight"])
            set_full(module.lora_B.weight, full[f"{name}.lora_B.weight"])
            filled += 1
    return filled


def load_lora_run_weights(parts: list[torch.nn.Module], spec: Any, job: Any, checkpoint: str | Path) -> str:
    """A LoRA run's checkpoint into ``parts`` (already adapted by ``apply_peft``), as a
    start of the run loads it: a full checkpoint (``peft.adapter_only_checkpoints=false``)
    as it is; an adapter-only one over its base, ``checkpoint.init_from`` or else
    ``model.hf``. Returns where the base came from (``checkpoint``, ``init_from`` or
    ``model.hf``). Used by titan-generate / titan-eval (one process, no process group)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    from titan_plugins.errors import ConfigError
    from titan_plugins.train.checkpoint import (
        _checkpoint_keys,
        load_model_weights,
        model_state_dict,
    )

    checkpoint = Path(checkpoint)
    keys = _checkpoint_keys(checkpoint)
    ours = model_state_dict(parts)
    if all(f"model.{k}" in keys for k in ours):  # base and adapters: a full checkpoint
        load_model_weights(parts, checkpoint)
        return "checkpoint"
    adapters = {k: v for k, v in ours.items() if is_adapter_key(k)}
    missing = [k for k in adapters if f"model.{k}" not in keys]
    if missing:
        raise ConfigError(f"{checkpoint}: has no adapter {missing[0]} (and {len(missing) - 1} more): "
                          "not a checkpoint of this LoRA run's targets")
    if job.checkpoint.get("init_from"):
        load_model_weights(parts, job.checkpoint.init_from)
        source = "init_from"
    elif job.model.get("hf"):
        from titan_plugins.config.hydra_glue import model_config
        from titan_plugins.hf.load import load_hf_weights

        load_hf_weights(parts, spec, model_config(job.model, spec), job.model.hf, verbose=False)
        source = "model.hf"
    else:
        raise ConfigError(f"{checkpoint}: holds only LoRA adapters and the run names no base "
                          "(model.hf or checkpoint.init_from) to put them on")
    state = {"model": adapters}
    dcp.load(state, checkpoint_id=str(checkpoint))
    for part in parts:
        set_model_state_dict(part, state["model"], options=StateDictOptions(strict=False))
    return source
