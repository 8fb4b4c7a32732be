"""Write a Hugging Face model folder: config.json (the plugin's ``config_to_hf``),
sharded safetensors with ``model.safetensors.index.json`` (names through the
adapter's ``to_hf``) and the run's tokenizer.json.

The weights come either from a live full state dict (``checkpoint.export_hf`` at
the end of a run) or from a DCP checkpoint taken under any parallelism, read in
one process with torch.distributed.checkpoint (no process group needed).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from titan_plugins.errors import ConfigError

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from titan_plugins.plugins import TitanPluginManager
    from titan_plugins.spec import ModelSpec

__all__ = ["export_checkpoint", "export_folder", "export_run", "find_checkpoint", "read_dcp_model", "write_safetensors"]

MAX_SHARD = "2GB"


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
    state: dict[str, Any] = {}
    _load_state_dict(state, storage_reader=reader, planner=_EmptyStateDictLoadPlanner(keys=keys), no_dist=True)
    model = state["model"]
    return {k: v for k, v in _flatten(model).items() if isinstance(v, torch.Tensor)}


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict):
        out: dict[str, Any] = {}
        for k, v in tree.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: tree}


def write_safetensors(hf_sd: dict[str, torch.Tensor], out: Path, dtype: torch.dtype | None = None) -> None:
    """Sharded ``*.safetensors`` plus ``model.safetensors.index.json``."""
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file

    tensors = {k: (v.to(dtype) if dtype else v).detach().cpu().contiguous().clone() for k, v in hf_sd.items()}
    split = split_torch_state_dict_into_shards(tensors, max_shard_size=MAX_SHARD)
    names = {}
    for file, keys in split.filename_to_tensors.items():
        # always an index, also for one file (readers accept both)
        name = file if split.is_sharded else "model-00001-of-00001.safetensors"
        save_file({k: tensors[k] for k in keys}, str(out / name), metadata={"format": "pt"})
        names.update({k: name for k in keys})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(names.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def _tokenizer_file(job: DictConfig) -> Path | None:
    tok = job.data.get("tokenizer") if hasattr(job, "data") else None
    if tok:
        p = Path(tok)
        p = p / "tokenizer.json" if p.is_dir() else p
        return p if p.is_file() else None
    try:
        from titan_plugins.train.data.tokenizer import DEFAULT_TOKENIZER
    except ImportError:
        return None
    p = Path(DEFAULT_TOKENIZER)
    return p if p.is_file() else None


def export_folder(spec: ModelSpec, config: Any, job: DictConfig, state_dict: dict[str, torch.Tensor], out: str | Path) -> Path:
    """Write ``out`` (replaced if it exists) from our full ``state_dict``."""
    to_hf_config = spec.load("config_to_hf")
    adapter_cls = spec.load("state_dict_adapter")
    if to_hf_config is None or adapter_cls is None or not hasattr(adapter_cls, "to_hf"):
        raise ConfigError(f"model {spec.name!r} cannot be exported: its plugin has no config_to_hf or adapter to_hf")
    hf_config = to_hf_config(config)
    hf_sd = adapter_cls(config).to_hf(state_dict)
    out = Path(out)
    tmp = out.with_name(out.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    dtypes = {t.dtype for t in hf_sd.values() if t.is_floating_point()}
    if len(dtypes) == 1:  # the weights as trained (precision.weight_dtype)
        hf_config["dtype"] = str(dtypes.pop()).removeprefix("torch.")
    (tmp / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    write_safetensors(hf_sd, tmp)
    tokenizer = _tokenizer_file(job)
    if tokenizer is not None:
        shutil.copyfile(tokenizer, tmp / "tokenizer.json")
        for extra in ("tokenizer_config.json", "special_tokens_map.json"):
            if (tokenizer.parent / extra).is_file():
                shutil.copyfile(tokenizer.parent / extra, tmp / extra)
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return out


def export_checkpoint(path: str | Path, out: str | Path, pm: TitanPluginManager | None = None) -> Path:
    """``titan-export``: a run directory or one of its DCP checkpoints to ``out``."""
    from omegaconf import OmegaConf

    from titan_plugins.config.hydra_glue import model_config
    from titan_plugins.plugins import get_plugin_manager

    run_dir, checkpoint = find_checkpoint(path)
    job = OmegaConf.load(run_dir / "config.yaml")
    pm = pm or get_plugin_manager()
    spec = pm.get_model(job.model.name)
    config = model_config(job.model, spec)
    return export_folder(spec, config, job, read_dcp_model(checkpoint), out)


def export_run(trainer: Any, out: str | Path | None = None) -> Path | None:
    """``checkpoint.export_hf=true``: gather the trained weights to rank 0 and write
    ``<run_dir>/hf`` there; every rank returns after rank 0 has written."""
    import torch.distributed as dist

    from titan_plugins.config.hydra_glue import model_config
    from titan_plugins.train.checkpoint import full_model_state_dict

    sd = full_model_state_dict(trainer.model.parts, trainer.pp_group)
    written = None
    if trainer.rank == 0 and sd is not None:
        config = model_config(trainer.job.model, trainer.spec)
        written = export_folder(trainer.spec, config, trainer.job, sd, out or Path(trainer.run_dir) / "hf")
    dist.barrier()
    return written
