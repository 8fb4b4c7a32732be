"""A model ready to sample from: a run's DCP checkpoint or a Hugging Face folder,
built in this process on one device (no process group)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from omegaconf import OmegaConf

from titan_plugins.errors import ConfigError
from titan_plugins.generate.sampling import supports_generation

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from titan_plugins.plugins import TitanPluginManager
    from titan_plugins.spec import ModelSpec


@dataclass
class Loaded:
    model: torch.nn.Module
    tokenizer: Any
    job: DictConfig
    source: Path


def _materialize(spec: ModelSpec, job: DictConfig, device: torch.device) -> torch.nn.Module:
    """The run's model as it trained: built on meta, with a LoRA run's adapters
    (``peft=lora``: the same transform, titan_plugins/peft), materialized."""
    from titan_plugins.model.lifecycle import apply_peft, build_meta_model
    from titan_plugins.peft.lora import init_adapters

    model = build_meta_model(spec, job)
    if not supports_generation(model):
        raise ConfigError(
            f"model={spec.name}: its forward takes no cache= (the plugin does not support generation)"
        )
    apply_peft(model, spec, job)
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_weights(buffer_device=device)
    init_adapters(model, int(job.training.seed))
    return model


def load_checkpoint(path: str | Path, device: torch.device, pm: TitanPluginManager | None = None) -> Loaded:
    """A run directory (its newest ``step-N``) or one DCP checkpoint inside a run dir.
    A LoRA run's adapter-only checkpoint goes onto its base (``checkpoint.init_from``,
    else ``model.hf``), as a start of the run puts it."""
    from titan_plugins.checkpoint.checkpointer import load_model_weights
    from titan_plugins.data.tokenizer import build_tokenizer
    from titan_plugins.export.source import find_checkpoint
    from titan_plugins.peft.lora import lora_enabled
    from titan_plugins.peft.run_weights import load_lora_run_weights
    from titan_plugins.plugins import get_plugin_manager
    from titan_plugins.train.api import typed_job

    run_dir, checkpoint = find_checkpoint(path)
    job = typed_job(OmegaConf.load(run_dir / "config.yaml"))
    pm = pm or get_plugin_manager()
    spec = pm.get_model(job.model.name)
    model = _materialize(spec, job, device)
    if lora_enabled(job):
        load_lora_run_weights([model], spec, job, checkpoint)
    else:
        load_model_weights([model], checkpoint)
    return Loaded(model, build_tokenizer(job.data), job, checkpoint)


def load_hf(folder: str | Path, model_name: str, device: torch.device, pm: TitanPluginManager | None = None) -> Loaded:
    """A Hugging Face folder through the plugin's config mapping and adapter (``model.hf``)."""
    from titan_plugins.config.hydra_glue import compose, model_config, resolve_job
    from titan_plugins.data.tokenizer import build_tokenizer
    from titan_plugins.hf.load import load_hf_weights
    from titan_plugins.plugins import get_plugin_manager
    from titan_plugins.train.api import typed_job

    pm = pm or get_plugin_manager()
    spec, job = resolve_job(compose([f"model={model_name}", f"model.hf={folder}"], pm), pm)
    job = typed_job(job)
    model = _materialize(spec, job, device)
    load_hf_weights([model], spec, model_config(job.model, spec), folder,
                    partial=bool(job.model.get("hf_partial")))
    return Loaded(model, build_tokenizer(job.data), job, Path(folder))
