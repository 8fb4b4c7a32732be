"""The PEFT adapter folder format: what ``peft.PeftModel.from_pretrained(base, DIR)``
reads. The base model's Hugging Face module names (``mapping.py``: from the plugin's
``to_hf``), keys ``base_model.model.<module>.lora_A.weight`` / ``lora_B.weight``.

Grouped MoE expert adapters are written per expert, as peft keeps LoRA on per-expert
linears (``...mlp.experts.{e}.gate_proj.lora_A.weight``; ``mapping.expert_hf_targets``);
peft converts them to transformers 5's fused experts when it loads them.

``to_peft`` turns our adapters into those keys (the export writes them:
``titan_plugins.export.lora``); ``read_peft_adapter`` reads such a folder back into our
adapters (``peft.init_from=DIR``, ``peft/checkpoint.py``). ``read_adapter_config``,
``stored_shapes`` (the safetensors header alone) and ``check_stored`` (against
``adapter_pairs``, the keys and shapes the run reads) are also what the launcher checks
before any rank starts (``train/prelaunch_peft.py``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from titan_plugins.errors import ConfigError
from titan_plugins.peft.experts import expert_weight_key
from titan_plugins.peft.mapping import expert_hf_targets, hf_targets, state_dict_adapter

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from titan_plugins.spec import ModelSpec

__all__ = ["ADAPTER_CONFIG", "ADAPTER_WEIGHTS", "PEFT_PREFIX", "Pair", "adapter_pairs", "check_expert_layout",
           "check_stored", "read_adapter_config", "read_peft_adapter", "stored_shapes", "to_peft"]

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
Shapes = dict[str, tuple[int, ...]]  # adapted module -> (out, in); grouped experts (experts, out, in)


def to_peft(spec: ModelSpec, config: object, adapters: dict[str, torch.Tensor], shapes: Shapes,
            hf_folder: str | None = None, *, keys: str = "loaded") -> tuple[dict[str, torch.Tensor], list[str]]:
    """Our adapter tensors as PEFT's file keys, and the Hugging Face module names
    (``target_modules``: the loaded model's). ``keys="checkpoint"`` names the tensors as
    the checkpoint names the modules, where each is one module both ways (peft renames
    a file's keys through transformers' checkpoint conversion for some families)."""
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
        targets = hf_targets(adapter, module, shape)
        names = [t.module for t in targets]
        if keys == "checkpoint":
            stored = hf_targets(adapter, module, shape, loaded=False)
            if len(stored) != len(targets):
                raise ConfigError(f"peft.target_modules: {module} is {len(targets)} module(s) in transformers' "
                                  f"model and {len(stored)} in the checkpoint")
            names = [t.module for t in stored]
        for target, name in zip(targets, names, strict=True):
            tensors[f"{PEFT_PREFIX}{name}.lora_A.weight"] = a[:, target.cols].contiguous()
            tensors[f"{PEFT_PREFIX}{name}.lora_B.weight"] = b[target.rows].contiguous()
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


@dataclass(frozen=True)
class Pair:
    """One Hugging Face linear's adapter pair in the file, and where it goes in ours."""

    module: str  # our adapted module (``layers.0.attention.wq``)
    a: str  # its keys in adapter_model.safetensors
    b: str
    expert: int | None  # grouped experts: which expert of ours
    rows: torch.Tensor  # our output rows it holds (B's rows)
    cols: torch.Tensor  # our input columns (A's columns)

    def shapes(self, rank: int) -> tuple[tuple[int, int], tuple[int, int]]:
        """The shapes of its A and B in the file: ``[r, in]``, ``[out, r]``."""
        return (rank, len(self.cols)), (len(self.rows), rank)


def adapter_pairs(spec: ModelSpec, config: object, shapes: Shapes, hf_folder: str | None = None,
                  stored: dict[str, tuple[int, ...]] | None = None) -> list[Pair]:
    """Every pair of file keys the run's adapted modules (``shapes``) read: named as the
    loaded model names its modules (what peft saves), or, where ``stored`` (the file's
    names) holds a module under its checkpoint name instead, under that one."""
    adapter = state_dict_adapter(spec, config, hf_folder)
    out = []
    for module, shape in shapes.items():
        if len(shape) == 3:  # grouped experts: one linear per expert
            targets = [(t.module, t.expert, t.rows, t.cols)
                       for t in expert_hf_targets(adapter, expert_weight_key(module), shape)]
        else:
            found = hf_targets(adapter, module, shape)
            if stored is not None and f"{PEFT_PREFIX}{found[0].module}.lora_A.weight" not in stored:
                found = hf_targets(adapter, module, shape, loaded=False)
            targets = [(t.module, None, t.rows, t.cols) for t in found]
        for name, expert, rows, cols in targets:
            out.append(Pair(module, f"{PEFT_PREFIX}{name}.lora_A.weight", f"{PEFT_PREFIX}{name}.lora_B.weight",
                            expert, rows, cols))
    return out


def read_adapter_config(folder: str | Path, peft: DictConfig) -> dict:
    """``adapter_config.json``: a LoRA adapter of the run's rank and alpha (``peft.rank``,
    ``peft.alpha``), or one line naming the folder as given and what is wrong."""
    key = f"peft.init_from={folder}"
    path = Path(folder) / ADAPTER_CONFIG
    if not path.is_file():
        raise ConfigError(f"{key}: no PEFT adapter there (missing {ADAPTER_CONFIG})")
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{key}: {ADAPTER_CONFIG} is not readable JSON ({type(exc).__name__}: {exc})") from None
    if not isinstance(cfg, dict):
        raise ConfigError(f"{key}: {ADAPTER_CONFIG} is not a JSON object")
    if str(cfg.get("peft_type", "LORA")).upper() != "LORA":
        raise ConfigError(f"{key}: a {cfg.get('peft_type')} adapter, not LoRA")
    for ours, theirs in (("rank", "r"), ("alpha", "lora_alpha")):
        try:
            same = float(cfg.get(theirs, -1)) == float(peft[ours])
        except (TypeError, ValueError):
            same = False
        if not same:
            raise ConfigError(f"{key}: the adapter has {theirs}={cfg.get(theirs)}, the run peft.{ours}={peft[ours]}")
    return cfg


def stored_shapes(folder: str | Path) -> dict[str, tuple[int, ...]]:
    """``adapter_model.safetensors``' tensor names and shapes, from its header alone (the
    safetensors library checks that the tensors cover the file); one line when it is
    missing or damaged."""
    from safetensors import SafetensorError, safe_open

    key = f"peft.init_from={folder}"
    path = Path(folder) / ADAPTER_WEIGHTS
    if not path.is_file():
        raise ConfigError(f"{key}: no {ADAPTER_WEIGHTS}")
    try:
        with safe_open(str(path), framework="pt") as f:
            return {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}  # noqa: SIM118
    except (SafetensorError, OSError, ValueError) as exc:
        raise ConfigError(f"{key}: {ADAPTER_WEIGHTS} is damaged ({exc})") from None


def check_stored(folder: str | Path, stored: dict[str, tuple[int, ...]], pairs: list[Pair], rank: int) -> None:
    """The file holds every pair the run reads, at the run's shapes, and nothing else."""
    key = f"peft.init_from={folder}"
    used: set[str] = set()
    for pair in pairs:
        for name, want in zip((pair.a, pair.b), pair.shapes(rank)):
            if name not in stored:
                raise ConfigError(f"{key}: has no {name} (the run adapts {pair.module})")
            if tuple(stored[name]) != want:
                raise ConfigError(
                    f"{key}: {ADAPTER_WEIGHTS} holds {name} of shape {list(stored[name])}, the model's is "
                    f"{list(want)} (an adapter saved for another model's shapes)")
            used.add(name)
    extra = sorted(set(stored) - used)
    if extra:
        raise ConfigError(f"{key}: {len(extra)} tensors the run does not adapt, e.g. {extra[0]} "
                          "(set peft.target_modules to the adapter's modules)")


def read_peft_adapter(spec: ModelSpec, config: object, peft: DictConfig, folder: str | Path,
                      shapes: Shapes, hf_folder: str | None = None) -> dict[str, torch.Tensor]:
    """A PEFT adapter folder as our full adapter tensors (``{module.lora_A.weight: A}``).
    Its rank and alpha must be the run's (``peft.rank``, ``peft.alpha``); what the
    launcher checked before any rank started (``train/prelaunch_peft.py``) is checked
    again here, for callers that load a folder without launching."""
    from safetensors.torch import load_file

    read_adapter_config(folder, peft)
    stored_names = stored_shapes(folder)
    rank = int(peft.rank)
    pairs = adapter_pairs(spec, config, shapes, hf_folder, stored_names)
    check_stored(folder, stored_names, pairs, rank)
    stored = load_file(str(Path(folder) / ADAPTER_WEIGHTS))
    out: dict[str, torch.Tensor] = {}
    for module, shape in shapes.items():
        if len(shape) == 3:  # grouped experts
            out[f"{module}.lora_A.weight"] = torch.zeros(shape[0], rank, shape[2])
            out[f"{module}.lora_B.weight"] = torch.zeros(shape[0], shape[1], rank)
        else:
            out[f"{module}.lora_A.weight"] = torch.zeros(rank, shape[1])
            out[f"{module}.lora_B.weight"] = torch.zeros(shape[0], rank)
    for pair in pairs:
        a, b = out[f"{pair.module}.lora_A.weight"], out[f"{pair.module}.lora_B.weight"]
        if pair.expert is not None:
            a, b = a[pair.expert], b[pair.expert]
        a[:, pair.cols] = stored[pair.a].float()
        b[pair.rows] = stored[pair.b].float()
    return out
