"""A LoRA run's exports: the merged model (kind ``merged``) and its PEFT adapter folder
(kind ``peft-adapter``).

    titan-export RUN --adapter --out DIR   adapter_config.json + adapter_model.safetensors
    titan-export RUN --merge --out DIR     a full Hugging Face folder, adapters folded in
    checkpoint.export_hf=true              both at the end of the run: <run_dir>/hf (merged)
                                           and <run_dir>/hf-adapter (PEFT)

LoRA on grouped MoE experts merges per expert (``W[e] + alpha/rank * B[e] A[e]``); its
adapter is written per expert where the Hugging Face folder keeps one linear per expert
(peft converts it to transformers 5's fused experts). Where it does not (Llama 4's fused
``gate_up_proj``) ``--adapter`` is refused in one line pointing to ``--merge``, and
``checkpoint.export_hf=true`` writes the merged folder only, saying why in one line.

The adapter folder's format is ``titan_plugins.peft.folder``'s (what
``peft.PeftModel.from_pretrained(base, DIR)`` reads); the merged folder is written by
the same writer as a full export (``hf_folder.write_hf_folder``).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from titan_plugins.distributed.fsdp import to_torch_dtype
from titan_plugins.errors import ConfigError
from titan_plugins.export.hf_folder import write_hf_folder
from titan_plugins.export.out_dir import claim_out_dir, write_export
from titan_plugins.export.source import find_checkpoint, read_dcp_model
from titan_plugins.peft.checkpoint import adapter_shapes, checkpoint_filter
from titan_plugins.peft.folder import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    check_expert_layout,
    to_peft,
)
from titan_plugins.peft.lora import is_adapter_key, lora_enabled, merge_into
from titan_plugins.peft.qlora import qlora_enabled, round_trip_base
from titan_plugins.peft.readback import choose_peft_layout

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from titan_plugins.spec import ModelSpec

__all__ = [
    "adapter_out_dir",
    "base_state_dict",
    "export_adapter",
    "export_hf_folders",
    "export_lora_live",
    "export_merged",
    "refuse_lora_full_export",
]

StateDict = dict[str, torch.Tensor]


# ------------------------------------------------------------------ titan-export
def refuse_lora_full_export(path: str | Path) -> None:
    """A plain ``titan-export`` of a LoRA run with adapter-only checkpoints is one line."""
    from omegaconf import OmegaConf

    run_dir, _ = find_checkpoint(path)
    if checkpoint_filter(OmegaConf.load(run_dir / "config.yaml")) is not None:
        raise ConfigError(f"{path}: a LoRA run (its checkpoints hold only the adapters): "
                          "pass --adapter (a PEFT folder) or --merge (a full folder)")


def _run(path: str | Path) -> tuple[Path, Path, DictConfig, ModelSpec, object]:
    """``(run_dir, checkpoint, job, spec, model config)`` of a LoRA run."""
    from omegaconf import OmegaConf

    from titan_plugins.config.hydra_glue import model_config
    from titan_plugins.plugins import get_plugin_manager

    run_dir, checkpoint = find_checkpoint(path)
    job = OmegaConf.load(run_dir / "config.yaml")
    if not lora_enabled(job):
        raise ConfigError(f"{path}: the run did not train LoRA adapters (peft.method is not lora)")
    spec = get_plugin_manager().get_model(job.model.name)
    return run_dir, checkpoint, job, spec, model_config(job.model, spec)


def _write_adapter(folder: Path, job: DictConfig, layout: tuple[StateDict, list[str]]) -> None:
    """adapter_config.json and adapter_model.safetensors of ``layout`` (``peft_layout``) into ``folder``."""
    from safetensors.torch import save_file

    tensors, modules = layout
    (folder / ADAPTER_CONFIG).write_text(json.dumps(_adapter_config(job, modules), indent=2) + "\n")
    save_file({k: v.float().contiguous() for k, v in tensors.items()}, str(folder / ADAPTER_WEIGHTS),
              metadata={"format": "pt"})


def _adapter_config(job: DictConfig, modules: list[str]) -> dict:
    peft = job.peft
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": job.model.get("hf"),
        "r": int(peft.rank),
        "lora_alpha": float(peft.alpha),
        "lora_dropout": float(peft.dropout),
        "target_modules": sorted(set(modules)),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
    }


_CHOSEN_KEYS: dict[tuple, str] = {}  # what peft read back depends on names and shapes only


def peft_layout(spec: ModelSpec, config: object, job: DictConfig, adapters: StateDict
                ) -> tuple[StateDict, list[str]]:
    """``(tensors, target modules)`` of the PEFT folder: the layout peft reads back onto
    transformers' model of the run's folder (``peft/readback.py``), or one line why none.
    Decided once per folder and adapter shapes (vLLM's pushes write it every step)."""
    shapes, folder = adapter_shapes(spec, job), job.model.get("hf")
    memo = (spec.name, folder, tuple(sorted(shapes.items())), int(job.peft.rank))
    if memo in _CHOSEN_KEYS:
        return to_peft(spec, config, adapters, shapes, folder, keys=_CHOSEN_KEYS[memo])
    layouts = {keys: functools.partial(to_peft, spec, config, adapters, shapes, folder, keys=keys)
               for keys in ("loaded", "checkpoint")}
    chosen, layout = choose_peft_layout(folder, layouts, lambda modules: _adapter_config(job, modules),
                                        trust_remote_code=bool(job.model.get("trust_remote_code", False)))
    _CHOSEN_KEYS[memo] = chosen
    return layout


def write_peft_adapter(folder: Path, spec: ModelSpec, config: object, job: DictConfig, adapters: StateDict) -> None:
    """``adapters`` (ours) as a PEFT folder in ``folder`` (the one writer: exports, vLLM's pushes)."""
    _write_adapter(folder, job, peft_layout(spec, config, job, adapters))


def export_adapter(path: str | Path, out: str | Path, *, overwrite: bool = False) -> Path:
    """``titan-export RUN --adapter``: the run's adapters as a PEFT folder."""
    run_dir, checkpoint, job, spec, config = _run(path)
    target = claim_out_dir(out, "peft-adapter", overwrite=overwrite, protect={"the run directory": run_dir})
    adapters = {k: v for k, v in read_dcp_model(checkpoint).items() if is_adapter_key(k)}
    layout = peft_layout(spec, config, job, adapters)
    return write_export(target, "peft-adapter", lambda tmp: _write_adapter(tmp, job, layout))


def base_state_dict(job: DictConfig, spec: ModelSpec, config: object, checkpoint_sd: StateDict) -> StateDict:
    """The frozen base in our names: the checkpoint's own (a full one), else
    ``checkpoint.init_from``, else ``model.hf``."""
    base = {k: v for k, v in checkpoint_sd.items() if not is_adapter_key(k)}
    if base:
        return base
    if job.checkpoint.get("init_from"):
        return {k: v for k, v in read_dcp_model(job.checkpoint.init_from).items() if not is_adapter_key(k)}
    if job.model.get("hf"):
        from titan_plugins.hf.load import HFCheckpoint
        from titan_plugins.peft.mapping import state_dict_adapter

        adapter = state_dict_adapter(spec, config, job.model.hf)
        with HFCheckpoint(job.model.hf) as ckpt:
            return adapter.from_hf({n: ckpt.read(n) for n in ckpt.weight_map})
    raise ConfigError("the run's checkpoints hold only adapters and it names no base "
                      "(model.hf or checkpoint.init_from): nothing to merge them into")


def export_merged(path: str | Path, out: str | Path, *, overwrite: bool = False) -> Path:
    """``titan-export RUN --merge``: base + ``alpha/rank * B A`` as a Hugging Face folder."""
    run_dir, checkpoint, job, spec, config = _run(path)
    target = claim_out_dir(out, "merged", overwrite=overwrite, protect={"the run directory": run_dir})
    sd = read_dcp_model(checkpoint)
    adapters = {k: v for k, v in sd.items() if is_adapter_key(k)}
    base = base_state_dict(job, spec, config, sd)
    if qlora_enabled(job):  # the adapters were trained over the 4-bit base: merge into that
        base = round_trip_base(base, adapters, to_torch_dtype(job.precision.weight_dtype))
    merged = merge_into(base, adapters, float(job.peft.alpha) / int(job.peft.rank))
    return write_export(target, "merged", lambda tmp: write_hf_folder(tmp, spec, config, job, merged))


# ------------------------------------------------------------------ end of a run
def adapter_out_dir(out: str | Path) -> Path:
    """Where ``checkpoint.export_hf=true`` writes a LoRA run's PEFT adapter: next to the
    merged folder ``out``, named ``<out>-adapter`` (``<run_dir>/hf-adapter``)."""
    out = Path(out)
    return out.with_name(out.name + "-adapter")


def export_hf_folders(job: DictConfig, out: str | Path) -> list[tuple[Path, str]]:
    """The folders ``checkpoint.export_hf=true`` writes, with their export kinds:
    ``out`` (``full``); for a LoRA run ``out`` (``merged``) and ``<out>-adapter``
    (``peft-adapter``). The pre-launch check claims the same ones."""
    if not lora_enabled(job):
        return [(Path(out), "full")]
    return [(Path(out), "merged"), (adapter_out_dir(out), "peft-adapter")]


def export_lora_live(spec: ModelSpec, config: object, job: DictConfig, state_dict: StateDict, out: str | Path,
                     run_dir: str | Path) -> Path:
    """``checkpoint.export_hf=true`` on a LoRA run (rank 0, the gathered live weights:
    base and adapters): the merged model to ``out`` (``<run_dir>/hf``, what
    ``from_pretrained`` loads, as for full training) and the PEFT adapter to
    :func:`adapter_out_dir` (``<run_dir>/hf-adapter``). Earlier exports of the run
    (same kinds) are replaced; anything else there is refused (``out_dir.py``)."""
    adapters = {k: v for k, v in state_dict.items() if is_adapter_key(k)}
    merged = merge_into(state_dict, adapters, float(job.peft.alpha) / int(job.peft.rank))
    protect = {"the run directory": run_dir}
    written: list[Path] = []
    try:  # adapted experts without a PEFT layout, or one peft misreads: the merged folder alone, and why
        check_expert_layout(spec, config, adapter_shapes(spec, job), job.model.get("hf"))
        layout = peft_layout(spec, config, job, adapters)
        no_adapter = None
    except ConfigError as exc:
        layout, no_adapter = None, str(exc)
    for folder, kind in export_hf_folders(job, out):
        if kind == "peft-adapter" and no_adapter is not None:
            print(f"checkpoint.export_hf=true: no {folder}: {no_adapter}", flush=True)
            continue
        target = claim_out_dir(folder, kind, overwrite=True, protect=protect, key="checkpoint.export_hf")
        if kind == "merged":
            written.append(write_export(target, kind, lambda tmp: write_hf_folder(tmp, spec, config, job, merged)))
        else:
            written.append(write_export(target, kind, lambda tmp: _write_adapter(tmp, job, layout)))
    return written[0]
