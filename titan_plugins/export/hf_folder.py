"""The one writer of a Hugging Face model folder: config.json (the plugin's
``config_to_hf``, laid over the source folder's), sharded safetensors with
``model.safetensors.index.json`` (names through the adapter's ``to_hf``), and the
tokenizer and generation files beside them. Full and merged exports both write
through :func:`write_hf_folder`; where and whether is ``out_dir.py``'s.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from titan_plugins.errors import ConfigError
from titan_plugins.export.out_dir import write_export
from titan_plugins.hf.config import FolderTokens

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from titan_plugins.protocols import HFStateDictAdapter
    from titan_plugins.spec import ModelSpec

__all__ = [
    "export_config", "export_folder", "folder_tokens", "hf_names", "make_adapter", "write_hf_folder",
    "write_safetensors",
]

MAX_SHARD = "2GB"
# config.json and the other JSON files: JSON values of any kind under string keys.
JSONDict = dict[str, Any]


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
    if not hasattr(job, "data"):  # titan_plugins.hf.api.export_model without a tokenizer
        return None
    tok = job.data.get("tokenizer")
    if tok:
        p = Path(tok)
        p = p / "tokenizer.json" if p.is_dir() else p
        return p if p.is_file() else None
    try:
        from titan_plugins.data.tokenizer import DEFAULT_TOKENIZER
    except ImportError:
        return None
    p = Path(DEFAULT_TOKENIZER)
    return p if p.is_file() else None


def make_adapter(spec: ModelSpec, config: object, hf_assets_path: str | Path | None = None) -> HFStateDictAdapter:
    """The plugin's state-dict adapter for ``config`` (``hf_assets_path``: the folder a
    load reads, for an adapter whose names depend on its layout)."""
    import inspect

    adapter_cls = spec.load("state_dict_adapter")
    if adapter_cls is None or not hasattr(adapter_cls, "to_hf"):
        raise ConfigError(f"model {spec.name!r} has no state-dict adapter with to_hf")
    if hf_assets_path is not None and "hf_assets_path" in inspect.signature(adapter_cls).parameters:
        return adapter_cls(config, hf_assets_path=str(hf_assets_path))
    return adapter_cls(config)


def hf_names(spec: ModelSpec, config: object, shapes: dict[str, tuple[int, ...]]) -> dict[str, list[str]]:
    """Which Hugging Face tensors each of the plugin's state-dict entries becomes
    (``{our name: [hf names]}``, empty where Hugging Face has no such tensor), from
    the adapter's ``to_hf`` on meta tensors of the given shapes. Entries fused on the
    Hugging Face side (gate and up projections in one tensor) name the fused tensor."""
    adapter = make_adapter(spec, config)
    meta = {k: torch.empty(tuple(s), device="meta") for k, s in shapes.items()}
    out: dict[str, list[str]] = {}
    for key, value in meta.items():
        try:
            out[key] = sorted(adapter.to_hf({key: value}))
            continue
        except Exception:  # needs its fused partners: map it with its layer's entries
            pass
        layer = _layer_prefix(key)
        group = {k: v for k, v in meta.items() if _layer_prefix(k) == layer}
        alone = {k: set(_try_to_hf(adapter, {k: v})) for k, v in group.items()}
        others = set().union(*[n for k, n in alone.items() if k != key])
        out[key] = sorted(set(adapter.to_hf(group)) - others)
    return out


def _layer_prefix(key: str) -> str:
    import re

    match = re.search(r"^(.*?\.\d+)\.", key)
    return match.group(1) if match else ""


def _try_to_hf(adapter: HFStateDictAdapter, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    try:
        return adapter.to_hf(sd)
    except Exception:
        return {}


def _folder_config(spec: ModelSpec, job: DictConfig) -> object:
    """The model config ``model.hf`` alone gives (flavor + config.json, no overrides)."""
    from omegaconf import OmegaConf

    from titan_plugins.hf.config import hf_model_values
    from titan_plugins.spec import resolve

    flavor = spec.flavor(job.model.get("flavor") or spec.default_flavor)
    merged = OmegaConf.merge(OmegaConf.structured(resolve(spec.config)), OmegaConf.structured(flavor),
                             hf_model_values(spec, job.model.hf))
    return OmegaConf.to_object(merged)


def _source_config(job: DictConfig) -> JSONDict | None:
    hf = job.model.get("hf") if hasattr(job, "model") else None
    if not hf or not (Path(hf) / "config.json").is_file():
        return None
    return json.loads((Path(hf) / "config.json").read_text())


def export_config(spec: ModelSpec, config: object, job: DictConfig) -> JSONDict:
    """config.json for the trained ``config``. From a run that loaded ``model.hf``: the
    folder's config.json with only what the run changed laid over it (a field whose
    ``config_to_hf`` value differs between the folder's own config and the run's), so
    what the folder said and the run did not change is written back unchanged (EOS
    lists, ``max_position_embeddings``, fields the plugin does not read)."""
    to_hf_config = spec.load("config_to_hf")
    if to_hf_config is None:
        raise ConfigError(f"model {spec.name!r} cannot be exported: its plugin has no config_to_hf")
    ours = to_hf_config(config)
    source = _source_config(job)
    if source is None:
        return ours
    if source.get("model_type") != ours.get("model_type") and isinstance(source.get("text_config"), dict):
        source = dict(source["text_config"])  # a multimodal folder: its text model is what trained
        source.update(architectures=ours.get("architectures"), model_type=ours.get("model_type"))
    try:
        baseline = to_hf_config(_folder_config(spec, job))
    except ConfigError:
        return ours
    changed = {k: v for k, v in ours.items() if k not in baseline or baseline[k] != v}
    return {**source, **changed}


def folder_tokens(job: DictConfig, hf_config: JSONDict, vocab_size: int | None) -> FolderTokens:
    """BOS/EOS/PAD for the export: the source folder's (``model.hf``) as it said them,
    else the run's tokenizer's; an id outside the model's vocabulary is left out."""
    source = _source_config(job)
    tokens = FolderTokens()
    tokenizer = _tokenizer_file(job)
    tok = None
    if tokenizer is not None:
        from titan_plugins.data.tokenizer import Tokenizer

        try:
            tok = Tokenizer.load(tokenizer)
        except Exception:  # a stub or foreign file: no ids from it
            tok = None
    if tok is not None:
        # the tokens the tokenizer names (not a pad it falls back to): an export adds no field
        # the source did not have (issue 35.6)
        for attr, name in (("bos", tok.bos_token_id), ("eos", tok.eos_id), ("pad", tok.stated_pad_id)):
            if name is not None and name >= 0:
                setattr(tokens, attr, int(name))
                tokens.names[f"{attr}_token"] = tok.tok.id_to_token(int(name))
    if source is not None:
        for attr in ("bos", "eos", "pad"):  # what the folder states wins, null included
            if f"{attr}_token_id" in source:
                setattr(tokens, attr, source[f"{attr}_token_id"])
    elif tokens.eos is None and hf_config.get("eos_token_id") is not None:
        tokens.eos = hf_config["eos_token_id"]

    def inside(v: int | list[int] | None) -> int | list[int] | None:
        if vocab_size is None or v is None:
            return v
        if isinstance(v, list):
            kept = [i for i in v if 0 <= int(i) < vocab_size]
            return kept or None
        return v if 0 <= int(v) < vocab_size else None

    tokens.bos, tokens.eos, tokens.pad = inside(tokens.bos), inside(tokens.eos), inside(tokens.pad)
    return tokens


def _write_side_files(tmp: Path, job: DictConfig, tokens: FolderTokens) -> None:
    """tokenizer.json (the run's), tokenizer_config.json, special_tokens_map.json,
    chat_template.jinja and generation_config.json: the source folder's where it has
    them, else written from ``tokens``."""
    tokenizer = _tokenizer_file(job)
    hf = job.model.get("hf") if hasattr(job, "model") else None
    sources = [Path(p) for p in (tokenizer.parent if tokenizer else None, hf) if p]
    if tokenizer is not None:
        shutil.copyfile(tokenizer, tmp / "tokenizer.json")
    for extra in ("tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                  "generation_config.json"):
        found = next((d / extra for d in sources if (d / extra).is_file()), None)
        if found is not None:
            shutil.copyfile(found, tmp / extra)
    ids = tokens.config_fields()
    if not (tmp / "generation_config.json").exists():
        (tmp / "generation_config.json").write_text(json.dumps(ids, indent=2) + "\n")
    if tokenizer is not None and not (tmp / "tokenizer_config.json").exists():
        tok_config: JSONDict = {"tokenizer_class": "PreTrainedTokenizerFast", **tokens.names}
        template = tmp / "chat_template.jinja"
        if template.is_file():
            tok_config["chat_template"] = template.read_text()
        (tmp / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2) + "\n")


def write_hf_folder(folder: Path, spec: ModelSpec, config: object, job: DictConfig,
                    state_dict: dict[str, torch.Tensor]) -> None:
    """Write the Hugging Face files of our full ``state_dict`` into ``folder`` (a
    staging folder). config.json is :func:`export_config`'s with the special-token ids
    of :func:`folder_tokens` and the weights' dtype; tokenizer and generation files go
    beside it (:func:`_write_side_files`)."""
    hf_config = export_config(spec, config, job)
    hf_sd = make_adapter(spec, config).to_hf(state_dict)
    tokens = folder_tokens(job, hf_config, getattr(config, "vocab_size", None))
    ids = tokens.config_fields()
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):  # the ids of folder_tokens only
        if key in ids:
            hf_config[key] = ids[key]
        elif hf_config.get(key, 0) is not None:  # none, or one outside the vocabulary: left out
            hf_config.pop(key, None)
        # stated as null (config.json's "pad_token_id": null): written as null, not dropped; else
        # transformers falls back to the class's default id, which may lie outside the vocabulary
    dtypes = {t.dtype for t in hf_sd.values() if t.is_floating_point()}
    if len(dtypes) == 1:  # the weights as trained (precision.weight_dtype)
        hf_config["dtype"] = str(dtypes.pop()).removeprefix("torch.")
    (folder / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    write_safetensors(hf_sd, folder)
    _write_side_files(folder, job, tokens)


def export_folder(spec: ModelSpec, config: object, job: DictConfig, state_dict: dict[str, torch.Tensor],
                  out: str | Path, kind: str = "full") -> Path:
    """Write ``out`` from our full ``state_dict`` as an export of ``kind`` (``full``, or
    ``merged`` for a LoRA run's): a new or empty folder, or an earlier export of the
    same kind (the caller claims it first: ``export/out_dir.py``)."""
    return write_export(out, kind, lambda tmp: write_hf_folder(tmp, spec, config, job, state_dict))
