"""A LoRA run's checkpoint loaded into a fresh model in one process (titan-generate,
titan-eval): a full checkpoint as it is, an adapter-only one over its base.

Its own module because it reads through ``checkpoint/checkpointer.py``, which imports
``peft/checkpoint.py`` (what a checkpoint keeps); this one sits above both.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from titan_plugins.peft.lora import is_adapter_key

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from titan_plugins.spec import ModelSpec

__all__ = ["load_lora_run_weights"]


def load_lora_run_weights(parts: list[torch.nn.Module], spec: ModelSpec, job: DictConfig,
                          checkpoint: str | Path) -> str:
    """A LoRA run's checkpoint into ``parts`` (already adapted by ``apply_peft``), as a
    start of the run loads it: a full checkpoint (``peft.adapter_only_checkpoints=false``)
    as it is; an adapter-only one over its base, ``checkpoint.init_from`` or else
    ``model.hf``. Returns where the base came from (``checkpoint``, ``init_from`` or
    ``model.hf``). Used by titan-generate / titan-eval (one process, no process group)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    from titan_plugins.checkpoint.checkpointer import (
        _checkpoint_keys,
        load_model_weights,
        model_state_dict,
    )
    from titan_plugins.errors import ConfigError

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

        load_hf_weights(parts, spec, model_config(job.model, spec), job.model.hf, verbose=False,
                        partial=bool(job.model.get("hf_partial")))
        source = "model.hf"
    else:
        raise ConfigError(f"{checkpoint}: holds only LoRA adapters and the run names no base "
                          "(model.hf or checkpoint.init_from) to put them on")
    state = {"model": adapters}
    dcp.load(state, checkpoint_id=str(checkpoint))
    for part in parts:
        set_model_state_dict(part, state["model"], options=StateDictOptions(strict=False))
    return source
