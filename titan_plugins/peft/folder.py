"""The PEFT adapter folder format: what ``peft.PeftModel.from_pretrained(base, DIR)``
reads. The base model's Hugging Face module names (``mapping.py``: from the plugin's
``to_hf``), keys ``base_model.model.<module>.lora_A.weight`` / ``lora_B.weight``.

Grouped MoE expert adapters are written per expert, as peft keeps LoRA on per-expert
linears (``...mlp.experts.{e}.gate_proj.lora_A.weight``; ``mapping.expert_hf_targets``);
peft converts them to transformers 5's fused experts when it loads them.

``to_peft`` turns our adapters into those keys (the export writes them:
``titan_plugins.export.lora``); ``read_peft_adapter`` reads such a folder back into our
adapters (``peft.init_from=DIR``, ``peft/checkpoint.py``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from titan_plugins.errors import ConfigError
from titan_plugins.peft.experts import expert_weight_key
from titan_plugins.peft.mapping import expert_hf_targets, hf_targets, state_dict_adapter

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from titan_plugins.spec import ModelSpec

__all__ = ["ADAPTER_CONFIG", "ADAPTER_WEIGHTS", "PEFT_PREFIX", "check_expert_layout", "read_peft_adapter",
           "to_peft"]

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
Shapes = dict[str, tuple[int, ...]]  # adapted module -> (out, in); grouped experts (experts, out, in)


def to_peft(spec: ModelSpec, config: object, adapters: dict[str, torch.Tensor], shapes: Shapes,
            hf_folder: str | None = None) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Our adapter tensors as PEFT's file keys, and the Hugging Face module names."""
    _refuse_half_gate_up(shapes)
    adapter = state_dict_adapter(spec, config, hf_folder)
    tensors: dict[str, torch.Tensor] = {}
    modules: list[str] = []
    for module, shape in shapes.items():
        a, b = adapters.get(f"{module}.lora_A.weight"), adapters.get(f"{module}.lora_B.weight")
        if a is None or b is None:
            raise ConfigError(f"the checkpoint holds no adapter for {module}")
        if len(shape) == 3:  # grouped experts: one linear per expert
            for t in expert_hf_targets(adapter, expert_weight_key(module), shape):
                tensors[f"{PEFT_PREFIX}{t.module}.lora_A.weight"] = a[t.expert][:, t.cols].contiguous()
                tensors[f"{PEFT_PREFIX}{t.module}.lora_B.weight"] = b[t.expert][t.rows].contiguous()
                modules.append(t.module)
            continue
        for target in hf_targets(adapter, module, shape):
            tensors[f"{PEFT_PREFIX}{target.module}.lora_A.weight"] = a[:, target.cols].contiguous()
            tensors[f"{PEFT_PREFIX}{target.module}.lora_B.weight"] = b[target.rows].contiguous()
            modules.append(target.module)
    return tensors, modules


def check_expert_layout(spec: ModelSpec, config: object, shapes: Shapes, hf_folder: str | None = None) -> None:
    """Raise the one-line ``ConfigError`` ``to_peft`` would for the grouped expert adapters
    in ``shapes`` (no per-expert linears on the Hugging Face side, gate without up)."""
    experts = {m: shape for m, shape in shapes.items() if len(shape) == 3}
    if not experts:
        return
    _refuse_half_gate_up(experts)
    adapter = state_dict_adapter(spec, config, hf_folder)
    for module, shape in experts.items():
        expert_hf_targets(adapter, expert_weight_key(module), shape)


def _refuse_half_gate_up(shapes: Shapes) -> None:
    """transformers 5 fuses each expert's gate and up projections (our ``w1``, ``w3``)
    into one tensor, and peft converts their adapters only as a pair."""
    adapted = {expert_weight_key(m) for m, shape in shapes.items() if len(shape) == 3}
    for weight in sorted(adapted):
        owner, _, leaf = weight.rpartition(".")
        partner = {"w1": "w3", "w3": "w1"}.get(leaf)
        if partner and f"{owner}.{partner}" not in adapted:
            raise ConfigError(
                f"peft.target_modules: adapts {owner}.{leaf} without {owner}.{partner}; peft loads expert "
                "adapters on transformers 5 (fused gate/up) only in pairs: target both (experts.w1, "
                "experts.w3) or export with --merge"
            )


def read_peft_adapter(spec: ModelSpec, config: object, peft: DictConfig, folder: str | Path,
                      shapes: Shapes, hf_folder: str | None = None) -> dict[str, torch.Tensor]:
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
    for module, shape in shapes.items():
        if len(shape) == 3:  # grouped experts
            a, b = torch.zeros(shape[0], rank, shape[2]), torch.zeros(shape[0], shape[1], rank)
            for t in expert_hf_targets(adapter, expert_weight_key(module), shape):
                names = [f"{PEFT_PREFIX}{t.module}.lora_{x}.weight" for x in "AB"]
                missing = [n for n in names if n not in stored]
                if missing:
                    raise ConfigError(f"{key}: has no {missing[0]} (the run adapts {module})")
                a[t.expert][:, t.cols] = stored[names[0]].float()
                b[t.expert][t.rows] = stored[names[1]].float()
                used.update(names)
            out[f"{module}.lora_A.weight"], out[f"{module}.lora_B.weight"] = a, b
            continue
        out_f, in_f = shape
        a = torch.zeros(rank, in_f)
        b = torch.zeros(out_f, rank)
        for target in hf_targets(adapter, module, (out_f, in_f)):
            names = [f"{PEFT_PREFIX}{target.module}.lora_{x}.weight" for x in "AB"]
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
