"""The public, in-process Hugging Face API for plugin tests and users.

    from titan_plugins.hf import export_model, load_hf_model

    model = load_hf_model("qwen3", "path/to/folder")          # one rank, CPU, fp32, eval()
    model = load_hf_model("qwen3", folder, overrides=["model.n_layers=2", "model.hf_partial=true"])
    export_model(model, "qwen3", "path/to/out")               # config.json, safetensors, tokenizer
    export_checkpoint("outputs/run", "path/to/out")           # a run's newest DCP checkpoint

``load_hf_model`` resolves the model config as ``titan-run model=NAME model.hf=FOLDER``
does (the flavor, config.json on top, ``overrides`` on top of that, the same one-line
errors), builds the model on meta, materializes it, runs ``init_weights`` and fills it
from the folder's safetensors with the core's loader (each rank reading only its shards'
slices). Given a :class:`~titan_plugins.distributed.parallel_dims.ParallelDims` whose
meshes are built (an initialised process group), the plugin's ``parallelize`` hook runs
first, as in a training run; pipeline parallelism is the trainer's (``titan-run``).

``export_model`` writes a Hugging Face folder from a live model through the plugin's
``config_to_hf`` and state-dict adapter; for a model ``load_hf_model`` returned it also
knows the source folder, so what config.json said and the model did not change is
written back unchanged. Under a process group every rank calls it (DTensors are
gathered) and rank 0 writes. Errors a user can cause raise
:class:`titan_plugins.errors.ConfigError` with one line.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from titan_plugins.errors import ConfigError
from titan_plugins.export.full import export_checkpoint

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from titan_plugins.distributed.parallel_dims import ParallelDims
    from titan_plugins.plugins import TitanPluginManager
    from titan_plugins.spec import ModelSpec

__all__ = ["export_checkpoint", "export_model", "load_hf_model", "resolve_hf_config"]

_DEGREES = ("dp_replicate", "dp_shard", "cp", "tp", "pp", "ep", "etp")


@dataclass(frozen=True)
class _Loaded:
    """What ``load_hf_model`` knows about a model it returned (for ``export_model``)."""

    name: str
    config: Any
    folder: str
    flavor: str | None


_LOADED: weakref.WeakKeyDictionary[nn.Module, _Loaded] = weakref.WeakKeyDictionary()


def _override_list(overrides: Sequence[str] | Mapping[str, Any] | None) -> list[str]:
    """Hydra override strings; a mapping ``{"n_layers": 2}`` means ``model.n_layers=2``."""
    if overrides is None:
        return []
    if isinstance(overrides, str):
        raise ConfigError(f"overrides={overrides!r}: give a list of KEY=VALUE strings or a mapping")
    if isinstance(overrides, Mapping):
        import json

        out = []
        for key, value in overrides.items():
            key = key if "." in key or "=" in key else f"model.{key}"
            text = "null" if value is None else json.dumps(value) if not isinstance(value, str) else value
            out.append(f"{key}={text}")
        return out
    return [str(o) for o in overrides]


def _job(model_name: str, folder: str | Path, overrides: Sequence[str] | Mapping[str, Any] | None,
         pm: TitanPluginManager) -> tuple[ModelSpec, DictConfig]:
    """The resolved, typed job of ``model=NAME model.hf=FOLDER *overrides`` (no data checks)."""
    from titan_plugins.config.hydra_glue import compose, resolve_job
    from titan_plugins.data.special_tokens import hand_special_tokens
    from titan_plugins.hf.config import read_hf_config
    from titan_plugins.train.api import typed_job

    read_hf_config(folder)  # the folder's own one-line errors first
    cfg = compose([f"model={model_name}", f"model.hf={Path(folder)}", *_override_list(overrides)], pm)
    spec, job = resolve_job(cfg, pm)
    hand_special_tokens(spec, job, cfg.model)
    return spec, typed_job(job)


def resolve_hf_config(model_name: str, folder: str | Path,
                      overrides: Sequence[str] | Mapping[str, Any] | None = None, *,
                      pm: TitanPluginManager | None = None) -> Any:
    """The plugin's config (an instance of its schema) for ``folder``: what
    :func:`load_hf_model` builds, without building it."""
    from titan_plugins.config.hydra_glue import model_config
    from titan_plugins.plugins import get_plugin_manager

    pm = pm or get_plugin_manager()
    spec, job = _job(model_name, folder, overrides, pm)
    return model_config(job.model, spec)


def load_hf_model(
    model_name: str,
    folder: str | Path,
    *,
    parallelism: ParallelDims | None = None,
    overrides: Sequence[str] | Mapping[str, Any] | None = None,
    device: str | torch.device = "cpu",
    seed: int = 0,
    pm: TitanPluginManager | None = None,
) -> nn.Module:
    """The plugin's model ``model_name`` with the weights of the Hugging Face folder
    ``folder`` (config.json, ``*.safetensors``), in eval mode, on ``device``.

    ``overrides``: Hydra overrides as for ``titan-run`` (``["model.n_layers=2",
    "model.hf_partial=true", "precision.weight_dtype=bf16"]``) or a mapping of model
    fields (``{"n_layers": 2}``). ``parallelism``: a ``ParallelDims`` with its meshes
    built (``build_meshes``) on an initialised process group; every rank calls this and
    gets its shards (DTensors). Without it, one process holds the whole model.
    Entries the folder lacks (a tied output weight, an expert bias) keep what
    ``init_weights`` gave them under ``seed``. ``pm``: a plugin manager (default: the
    installed plugins and ``TITAN_PLUGINS_EXTRA``)."""
    from titan_plugins.config.hydra_glue import model_config
    from titan_plugins.distributed.fsdp import to_torch_dtype
    from titan_plugins.distributed.parallel_dims import ParallelDims
    from titan_plugins.hf.load import load_hf_weights
    from titan_plugins.plugins import get_plugin_manager

    pm = pm or get_plugin_manager()
    spec, job = _job(model_name, folder, overrides, pm)
    config = model_config(job.model, spec)
    device = torch.device(device)
    dims = parallelism
    if dims is None:
        for key in _DEGREES:
            job.parallelism[key] = 1
        dims = ParallelDims.from_config(job.parallelism, 1)
    else:
        if dims.pp > 1:
            raise ConfigError(f"parallelism: pp={dims.pp}: load_hf_model returns one module; pipeline "
                              "stages are the trainer's (titan-run model.hf=...)")
        if not dims._meshes:
            raise ConfigError("parallelism: its meshes are not built; call build_meshes(device_type) "
                              "on an initialised process group first")
        for key in _DEGREES:
            job.parallelism[key] = getattr(dims, key)
        job.parallelism.world_size = dims.world_size
    validate = spec.load("validate")
    if validate is not None:
        validate(config, dims)

    if parallelism is None:
        with torch.device("meta"):
            model = spec.load("build")(config)
    else:
        from titan_plugins.model.lifecycle import parallelized_parts

        ((_, model),) = parallelized_parts(spec, job, dims, pm)
    model.to_empty(device=device)
    torch.manual_seed(seed)
    with torch.no_grad():
        model.init_weights(buffer_device=device)
    weight_dtype = to_torch_dtype(job.precision.weight_dtype)
    if weight_dtype != torch.float32:  # real floating tensors only (a complex rotary cache stays)
        model._apply(lambda t: t.to(weight_dtype) if t.is_floating_point() else t)
    load_hf_weights([model], spec, config, folder, verbose=False, partial=bool(job.model.get("hf_partial")))
    model.eval()
    _LOADED[model] = _Loaded(spec.name, config, str(Path(folder).resolve()), job.model.get("flavor"))
    return model


def _full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every entry as a full CPU tensor (DTensors gathered: a collective on every rank)."""
    from torch.distributed.tensor import DTensor

    out = {}
    for key, value in model.state_dict().items():
        if isinstance(value, DTensor):
            value = value.full_tensor()
        out[key] = value.detach().cpu()
    return out


def export_model(
    model: nn.Module,
    spec_or_name: ModelSpec | str,
    out: str | Path,
    *,
    config: Any = None,
    tokenizer: str | Path | None = None,
    source: str | Path | None = None,
    overwrite: bool = False,
    pm: TitanPluginManager | None = None,
) -> Path:
    """Write ``model`` (the plugin's ``spec_or_name``) as a Hugging Face folder ``out``:
    config.json, ``model.safetensors.index.json`` and shards, and beside them
    tokenizer.json, tokenizer_config.json and generation_config.json where a tokenizer
    is known. Returns ``out``.

    ``config``: the model's config (default: the one :func:`load_hf_model` used, else
    ``model.config``). ``source``: the folder the weights came from (default: the
    one :func:`load_hf_model` read); its config.json fields the model did not change
    and its side files are written back unchanged. ``tokenizer``: a tokenizer.json
    (or a folder holding one); default: the source folder's, if any. ``out`` must be
    new or empty, or (``overwrite=True``) an earlier full export."""
    from omegaconf import OmegaConf

    from titan_plugins.export.hf_folder import export_folder
    from titan_plugins.export.out_dir import claim_out_dir
    from titan_plugins.plugins import get_plugin_manager

    if isinstance(spec_or_name, str):
        spec = (pm or get_plugin_manager()).get_model(spec_or_name)
    else:
        spec = spec_or_name
    loaded = _LOADED.get(model)
    if loaded is not None and loaded.name != spec.name:
        loaded = None  # loaded as another model: its folder says nothing about this one
    if config is None:
        config = loaded.config if loaded is not None else getattr(model, "config", None)
    from titan_plugins.spec import resolve

    schema = resolve(spec.config)
    if not isinstance(config, schema):
        raise ConfigError(f"export_model: give config= (an instance of {schema.__name__}); "
                          f"the model carries {type(config).__name__}")
    if source is None and loaded is not None:
        source = loaded.folder
    if source is not None:
        from titan_plugins.hf.config import read_hf_config

        read_hf_config(source, key="source")
    if tokenizer is None and source is not None and (Path(source) / "tokenizer.json").is_file():
        tokenizer = source
    job: dict[str, Any] = {"model": {"name": spec.name, "hf": str(source) if source else None,
                                     "flavor": loaded.flavor if loaded and source == loaded.folder else None}}
    if tokenizer is not None:  # without a data node the export writes no tokenizer files
        path = Path(tokenizer)
        if not (path / "tokenizer.json" if path.is_dir() else path).is_file():
            raise ConfigError(f"tokenizer={tokenizer}: no tokenizer.json there")
        job["data"] = {"tokenizer": str(path)}

    import torch.distributed as dist

    state = _full_state_dict(model)
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    error: str | None = None
    written = Path(out)
    if rank0:
        try:
            claim_out_dir(out, "full", overwrite=overwrite, key="out")
            written = export_folder(spec, config, OmegaConf.create(job), state, out)
        except ConfigError as exc:
            error = str(exc).replace("pass --overwrite", "pass overwrite=True")
    if dist.is_initialized():  # every rank returns (or raises) after rank 0 has written
        box = [error]
        dist.broadcast_object_list(box, src=0)
        error = box[0]
    if error is not None:
        raise ConfigError(error)
    return written
