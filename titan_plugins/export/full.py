"""The trained model as a Hugging Face folder (export kind ``full``).

    titan-export RUN --out DIR     a run directory or one of its DCP checkpoints
    checkpoint.export_hf=true      at the end of a run: <run_dir>/hf (a LoRA run: merged
                                   and its PEFT adapter, ``lora.py``)
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from titan_plugins.errors import ConfigError
from titan_plugins.export.hf_folder import export_folder
from titan_plugins.export.out_dir import claim_out_dir
from titan_plugins.export.source import find_checkpoint, read_dcp_model

if TYPE_CHECKING:
    from titan_plugins.plugins import TitanPluginManager
    from titan_plugins.train.trainer import Trainer

__all__ = ["export_checkpoint", "export_run"]


def export_checkpoint(path: str | Path, out: str | Path, pm: TitanPluginManager | None = None, *,
                      overwrite: bool = False) -> Path:
    """``titan-export``: a run directory or one of its DCP checkpoints to ``out``
    (``overwrite``: replace an earlier full export there; nothing else is replaced)."""
    from omegaconf import OmegaConf

    from titan_plugins.config.hydra_glue import model_config
    from titan_plugins.plugins import get_plugin_manager

    run_dir, checkpoint = find_checkpoint(path)
    claim_out_dir(out, "full", overwrite=overwrite,
                  protect={"the run directory": run_dir, "the checkpoint": checkpoint})
    job = OmegaConf.load(run_dir / "config.yaml")
    pm = pm or get_plugin_manager()
    spec = pm.get_model(job.model.name)
    config = model_config(job.model, spec)
    return export_folder(spec, config, job, read_dcp_model(checkpoint), out)


def export_run(trainer: Trainer, out: str | Path | None = None) -> Path | None:
    """``checkpoint.export_hf=true``: gather the trained weights to rank 0 and write
    ``<run_dir>/hf`` there (a LoRA run: merged, and its PEFT adapter in
    ``<run_dir>/hf-adapter``); every rank returns after rank 0 has written."""
    import torch.distributed as dist

    from titan_plugins.config.hydra_glue import model_config
    from titan_plugins.peft.lora import lora_enabled
    from titan_plugins.train.checkpoint import full_model_state_dict

    sd = full_model_state_dict(trainer.model.parts, trainer.pp_group)
    written = None
    failed: ConfigError | None = None
    if trainer.rank == 0 and sd is not None:
        config = model_config(trainer.job.model, trainer.spec)
        out = out or Path(trainer.run_dir) / "hf"  # the run's own: an earlier export of it is replaced
        try:  # an export refused (it would not be the trained model) fails the run after the barrier
            if lora_enabled(trainer.job):  # merged to out, the PEFT adapter to <out>-adapter
                from titan_plugins.export.lora import export_lora_live

                written = export_lora_live(trainer.spec, config, trainer.job, sd, out, trainer.run_dir)
            else:
                claim_out_dir(out, "full", overwrite=True, protect={"the run directory": trainer.run_dir})
                written = export_folder(trainer.spec, config, trainer.job, sd, out)
        except ConfigError as exc:
            failed = exc
    dist.barrier()
    if failed is not None:
        raise ConfigError(f"checkpoint.export_hf=true: {failed}")
    return written
