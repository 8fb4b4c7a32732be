"""PEFT adapter folders and merged Hugging Face folders from a LoRA run.

    titan-export RUN --adapter --out DIR   adapter_config.json + adapter_model.safetensors
    titan-export RUN --merge --out DIR     a full Hugging Face folder, adapters folded in
    checkpoint.export_hf=true              both at the end of the run: <run_dir>/hf (merged)
                                           and <run_dir>/hf-adapter (PEFT)

The adapter folder is what ``peft.PeftModel.from_pretrained(base, DIR)`` reads: the
base model's Hugging Face module names (``mapping.py``: from the plugin's ``to_hf``),
keys ``base_model.model.<module>.lora_A.weight`` / ``lora_B.weight``. The same
mapping read backwards loads such a folder into a run (``peft.init_from=DIR``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from titan_plugins.errors import ConfigError
from titan_plugins.peft.lora import is_adapter_key, merge_into
from titan_plugins.peft.mapping import hf_targets, state_dict_adapter

__all__ = [
    "ADAPTER_CONFIG",
    "ADAPTER_WEIGHTS",
    "adapter_out_dir",
    "adapter_shapes",
    "export_adapter",
    "export_hf_folders",
    "export_lora_live",
    "export_merged",
    "read_peft_adapter",
    "refuse_lora_full_export",
    "to_peft",
]

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_PREFIX = "base_model.model."


def adapter_shapes(spec: Any, job: Any) -> dict[str, tuple[int, int]]:
    """Every adapted module of the run's model (built on meta): ``{name: (out, in)}``."""
    from titan_plugins.peft.lora import adapter_modules
    from titan_plugins.train.lifecycle import apply_peft, build_meta_model

    model = build_meta_model(spec, job)
    apply_peft(model, spec, job)
    return {name: (m.out_features, m.in_features) for name, m in adapter_modules(model)}


def to_peft(spec: Any, config: Any, adapters: dict[str, torch.Tensor], shapes: dict[str, tuple[int, int]],
            hf_folder: str | None = None) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Our adapter tensors as PEFT's file keys, and the Hugging Face module names."""
    adapter = state_dict_adapter(spec, config, hf_folder)
    tensors: dict[str, torch.Tensor] = {}
    modules: list[str] = []
    for module, shape in shapes.items():
        a, b = adapters.get(f"{module}.lora_A.weight"), adapters.get(f"{module}.lora_B.weight")
        if a is None or b is None:
            raise ConfigError(f"the checkpoint holds no adapter for {module}")
        for target in hf_targets(adapter, module, shape):
            tensors[f"{_PREFIX}{target.module}.lora_A.weight"] = a[:, target.cols].contiguous()
            tensors[f"{_PREFIX}{target.module}.lora_B.weight"] = b[target.rows].contiguous()
            modules.append(target.module)
    return tensors, modules


def read_peft_adapter(spec: Any, config: Any, peft: Any, folder: str | Path,
                      shapes: dict[str, tuple[int, int]], hf_folder: str | None = None) -> dict[str, torch.Tensor]:
    """A PEFT adapter folder as our full adapter tensors (``{module.lora_A.weight: A}``).
    Its rank and alpha must be the run's (``peft.rank``, ``peft.alpha``)."""
    from safetensors.torch import load_file

    folder = Path(folder)
    key = f"peft.init_from={folder}"
    try:
        cfg = json.loads((folder / ADAPTER_CONFIG).read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{key}: no readable {ADAPTER_CONFIG} ({type(exc).__name__})") from None
    if str(cfg.get("peft_type", "LORA")).upper() != "LORA":
        raise ConfigError(f"{key}: a {cfg.get('peft_type')} adapter, not LoRA")
    for ours, theirs in (("rank", "r"), ("alpha", "lora_alpha")):
        if float(cfg.get(theirs, -1)) != float(peft[ours]):
            raise ConfigError(f"{key}: the adapter has {theirs}={cfg.get(theirs)}, the run peft.{ours}={peft[ours]}")
    weights = folder / ADAPTER_WEIGHTS
    if not weights.is_file():
        raise ConfigError(f"{key}: no {ADAPTER_WEIGHTS}")
    stored = load_file(str(weights))
    adapter = state_dict_adapter(spec, config, hf_folder)
    rank = int(peft.rank)
    out: dict[str, torch.Tensor] = {}
    used: set[str] = set()
    for module, (out_f, in_f) in shapes.items():
        a = torch.zeros(rank, in_f)
        b = torch.zeros(out_f, rank)
        for target in hf_targets(adapter, module, (out_f, in_f)):
            names = [f"{_PREFIX}{target.module}.lora_{x}.weight" for x in "AB"]
            missing = [n for n in names if n not in stored]
            if missing:
                raise ConfigError(f"{key}: has no {missing[0]} (the run adapts {module})")
            a[:, target.cols] = stored[names[0]].float()
            b[target.rows] = stored[names[1]].float()
            used.update(names)
        out[f"{module}.lora_A.weight"], out[f"{module}.lora_B.weight"] = a, b
    extra = sorted(set(stored) - used)
    if extra:
        raise ConfigError(f"{key}: {len(extra)} tensors the run does not adapt, e.g. {extra[0]} "
                          "(set peft.target_modules to the adapter's modules)")
    return out


# ------------------------------------------------------------------ titan-export
def refuse_lora_full_export(path: str | Path) -> None:
    """A plain ``titan-export`` of a LoRA run with adapter-only checkpoints is one line."""
    from omegaconf import OmegaConf

    from titan_plugins.hf.export import find_checkpoint
    from titan_plugins.peft.checkpoint import checkpoint_filter

    run_dir, _ = find_checkpoint(path)
    if checkpoint_filter(OmegaConf.load(run_dir / "config.yaml")) is not None:
        raise ConfigError(f"{path}: a LoRA run (its checkpoints hold only the adapters): "
                          "pass --adapter (a PEFT folder) or --merge (a full folder)")


def _run(path: str | Path) -> tuple[Path, Path, Any, Any, Any]:
    from omegaconf import OmegaConf

    from titan_plugins.config.hydra_glue import model_config
    from titan_plugins.hf.export import find_checkpoint
    from titan_plugins.peft.lora import lora_enabled
    from titan_plugins.plugins import get_plugin_manager

    run_dir, checkpoint = find_checkpoint(path)
    job = OmegaConf.load(run_dir / "config.yaml")
    if not lora_enabled(job):
        raise ConfigError(f"{path}: the run did not train LoRA adapters (peft.method is not lora)")
    spec = get_plugin_manager().get_model(job.model.name)
    return run_dir, checkpoint, job, spec, model_config(job.model, spec)


def _claim(out: str | Path, kind: str, overwrite: bool, run_dir: Path) -> tuple[Path, Path]:
    from titan_plugins.hf.out_dir import claim_out_dir, staging_dir

    target = claim_out_dir(out, kind, overwrite=overwrite, protect={"the run directory": run_dir})
    return target, staging_dir(target)


def _write_adapter(tmp: Path, spec: Any, config: Any, job: Any, adapters: dict[str, torch.Tensor]) -> None:
    """adapter_config.json and adapter_model.safetensors of ``adapters`` into ``tmp``."""
    from safetensors.torch import save_file

    tensors, modules = to_peft(spec, config, adapters, adapter_shapes(spec, job), job.model.get("hf"))
    peft = job.peft
    meta = {
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
    (tmp / ADAPTER_CONFIG).write_text(json.dumps(meta, indent=2) + "\n")
    save_file({k: v.float().contiguous() for k, v in tensors.items()}, str(tmp / ADAPTER_WEIGHTS),
              metadata={"format": "pt"})


def _write_merged(tmp: Path, spec: Any, config: Any, job: Any, merged: dict[str, torch.Tensor]) -> None:
    """A full Hugging Face folder of ``merged`` (our names, no adapter keys) into ``tmp``."""
    from titan_plugins.hf.export import export_folder

    written = export_folder(spec, config, job, merged, tmp / "hf")
    for entry in written.iterdir():
        entry.rename(tmp / entry.name)
    written.rmdir()


def export_adapter(path: str | Path, out: str | Path, *, overwrite: bool = False) -> Path:
    """``titan-export RUN --adapter``: the run's adapters as a PEFT folder."""
    import shutil

    from titan_plugins.hf.export import read_dcp_model
    from titan_plugins.hf.out_dir import publish_dir

    run_dir, checkpoint, job, spec, config = _run(path)
    target, tmp = _claim(out, "peft-adapter", overwrite, run_dir)
    try:
        adapters = {k: v for k, v in read_dcp_model(checkpoint).items() if is_adapter_key(k)}
        _write_adapter(tmp, spec, config, job, adapters)
        return publish_dir(tmp, target, "peft-adapter")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def base_state_dict(job: Any, spec: Any, config: Any, checkpoint_sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The frozen base in our names: the checkpoint's own (a full one), else
    ``checkpoint.init_from``, else ``model.hf``."""
    base = {k: v for k, v in checkpoint_sd.items() if not is_adapter_key(k)}
    if base:
        return base
    from titan_plugins.hf.export import read_dcp_model

    if job.checkpoint.get("init_from"):
        return {k: v for k, v in read_dcp_model(job.checkpoint.init_from).items() if not is_adapter_key(k)}
    if job.model.get("hf"):
        from titan_plugins.hf.load import HFCheckpoint

        adapter = state_dict_adapter(spec, config, job.model.hf)
        with HFCheckpoint(job.model.hf) as ckpt:
            return adapter.from_hf({n: ckpt.read(n) for n in ckpt.weight_map})
    raise ConfigError("the run's checkpoints hold only adapters and it names no base "
                      "(model.hf or checkpoint.init_from): nothing to merge them into")


def export_merged(path: str | Path, out: str | Path, *, overwrite: bool = False) -> Path:
    """``titan-export RUN --merge``: base + ``alpha/rank * B A`` as a Hugging Face folder."""
    import shutil

    from titan_plugins.hf.export import read_dcp_model
    from titan_plugins.hf.out_dir import publish_dir

    run_dir, checkpoint, job, spec, config = _run(path)
    target, tmp = _claim(out, "merged", overwrite, run_dir)
    try:
        sd = read_dcp_model(checkpoint)
        adapters = {k: v for k, v in sd.items() if is_adapter_key(k)}
        merged = merge_into(base_state_dict(job, spec, config, sd), adapters, float(job.peft.alpha) / int(job.peft.rank))
        _write_merged(tmp, spec, config, job, merged)
        return publish_dir(tmp, target, "merged")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def adapter_out_dir(out: str | Path) -> Path:
    """Where ``checkpoint.export_hf=true`` writes a LoRA run's PEFT adapter: next to the
    merged folder ``out``, named ``<out>-adapter`` (``<run_dir>/hf-adapter``)."""
    out = Path(out)
    return out.with_name(out.name + "-adapter")


def export_hf_folders(job: Any, out: str | Path) -> list[tuple[Path, str]]:
    """The folders ``checkpoint.export_hf=true`` writes, with their export kinds:
    ``out`` (``full``); for a LoRA run ``out`` (``merged``) and ``<out>-adapter``
    (``peft-adapter``). The pre-launch check claims the same ones."""
    from titan_plugins.peft.lora import lora_enabled

    if not lora_enabled(job):
        return [(Path(out), "full")]
    return [(Path(out), "merged"), (adapter_out_dir(out), "peft-adapter")]


def export_lora_live(spec: Any, config: Any, job: Any, state_dict: dict[str, torch.Tensor], out: str | Path,
                     run_dir: str | Path) -> Path:
    """``checkpoint.export_hf=true`` on a LoRA run (rank 0, the gathered live weights:
    base and adapters): the merged model to ``out`` (``<run_dir>/hf``, what
    ``from_pretrained`` loads, as for full training) and the PEFT adapter to
    :func:`adapter_out_dir` (``<run_dir>/hf-adapter``). Earlier exports of the run
    (same kinds) are replaced; anything else there is refused (``hf/out_dir.py``)."""
    import shutil

    from titan_plugins.hf.out_dir import claim_out_dir, publish_dir, staging_dir

    adapters = {k: v for k, v in state_dict.items() if is_adapter_key(k)}
    merged = merge_into(state_dict, adapters, float(job.peft.alpha) / int(job.peft.rank))
    protect = {"the run directory": run_dir}
    written: list[Path] = []
    for folder, kind in export_hf_folders(job, out):
        target = claim_out_dir(folder, kind, overwrite=True, protect=protect, key="checkpoint.export_hf")
        tmp = staging_dir(target)
        try:
            if kind == "merged":
                _write_merged(tmp, spec, config, job, merged)
            else:
                _write_adapter(tmp, spec, config, job, adapters)
            written.append(publish_dir(tmp, target, kind))
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return written[0]
