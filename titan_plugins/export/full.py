"""The trained model as a Hugging Face folder (export kind ``full``).

    titan-export RUN --out DIR     a run directory or one of its DCP checkpoints
    checkpoint.export_hf=true      at the end of a run: <run_dir>/hf (a LoRA run: merged
                                   and its PEFT adapter, ``lora.py``)
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from titan_plugins.errors import ConfigError
from titan_plugins.export.hf_folder import export_folder
from titan_plugins.export.out_dir import claim_out_dir
from titan_plugins.export.source import find_checkpoint, read_dcp_model

if TYPE_CHECKING:
    from torch import nn
    from torch.distributed import ProcessGroup

    from titan_plugins.plugins import TitanPluginManager
    from titan_plugins.spec import ModelSpec

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


def export_run(parts: list[nn.Module], *, pp_group: ProcessGroup | None, rank: int, spec: ModelSpec,
               job: Any, run_dir: str | Path, out: str | Path | None = None) -> Path | None:
    """``checkpoint.export_hf=true``: gather the trained weights (this rank's model
    ``parts``) to rank 0 and write ``<run_dir>/hf`` there (a LoRA run: merged, and its
    PEFT adapter in ``<run_dir>/hf-adapter``); every rank returns after rank 0 has
    written. ``job`` is the run's resolved config (an OmegaConf DictConfig)."""
    import torch.distributed as dist

    from titan_plugins.checkpoint.checkpointer import full_model_state_dict
    from titan_plugins.config.hydra_glue import model_config
    from titan_plugins.peft.lora import lora_enabled

    sd = full_model_state_dict(parts, pp_group)
    written = None
    failed: ConfigError | None = None
    if rank == 0 and sd is not None:
        config = model_config(job.model, spec)
        out = out or Path(run_dir) / "hf"  # the run's own: an earlier export of it is replaced
        try:  # an export refused (it would not be the trained model) fails the run after the barrier
            if lora_enabled(job):  # merged to out, the PEFT adapter to <out>-adapter
                from titan_plugins.export.lora import export_lora_live

                written = export_lora_live(spec, config, job, sd, out, run_dir)
            else:
                claim_out_dir(out, "full", overwrite=True, protect={"the run directory": run_dir})
                written = export_folder(spec, config, job, sd, out)
        except ConfigError as exc:
            failed = exc
    dist.barrier()
    if failed is not None:
        raise ConfigError(f"checkpoint.export_hf=true: {failed}")
    return written
