"""Would peft read the adapter we write as we trained it? Checked before the PEFT folder
is written (``export/lora.py``); where not, the export writes the merged folder alone and
says why in one line, since peft drops adapter weights it finds no module for with a
warning at most, and the model it hands on is then silently not the one trained.

Two checks: the fused-experts rule of peft's own conversion tables
(``check_peft_reads_back``), and peft's own loader run on the model transformers builds
from the folder, on the meta device (``peft_load_report``: every key must land, every
adapted module must get its keys). peft adapts the loaded model's modules (the
``target_modules`` name those), but renames a file's keys through transformers'
checkpoint conversion for some families, so the keys are named as the loaded model
names them or, where peft reads only that, as the checkpoint does
(``choose_peft_layout``).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from titan_plugins.errors import ConfigError

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = ["check_peft_reads_back", "choose_peft_layout", "peft_converts_experts", "peft_load_report"]

_EXPERT = re.compile(r"\.experts\.\d+\.")


def _conversion_tables() -> tuple[Any, Any, Any, str] | None:
    try:  # peft's own tables of what it renames (private: absent from other versions)
        import peft
        from peft.utils.transformers_weight_conversion import (
            _MODEL_TO_CONVERSION_PATTERN,
            _MOE_FUSED_TARGETS,
            _MOE_TARGET_MODULE_MAPPING,
        )
    except ImportError:
        return None
    return _MODEL_TO_CONVERSION_PATTERN, _MOE_FUSED_TARGETS, _MOE_TARGET_MODULE_MAPPING, peft.__version__


def peft_converts_experts(model_type: str | None) -> bool:
    """Whether the installed peft turns per-expert adapters of ``model_type`` into
    transformers 5's fused experts when it loads them."""
    tables = _conversion_tables()
    if tables is None or model_type is None:
        return False
    family = tables[0].get(model_type)
    return family is not None and bool(tables[1].get(family))


def check_peft_reads_back(model_type: str | None, modules: list[str]) -> None:
    """Raise a one-line ``ConfigError`` where the installed peft would read the adapter of
    a ``model_type`` folder wrongly: for the MoE families transformers 5 fuses (its
    checkpoint conversion mapping, e.g. DeepSeek-V2/V3, GLM-4-MoE, ERNIE-4.5-MoE), peft
    takes every target ending in an expert projection's name (``gate_proj``, ``up_proj``,
    ``down_proj``) for the fused expert weights, so the adapters of a dense layer's MLP or
    of shared experts would be dropped without a word (their trained deltas lost)."""
    if not peft_converts_experts(model_type):
        return
    table, _, targets, version = _conversion_tables()  # type: ignore[misc]
    family = table[model_type]
    # the names peft maps onto the experts' fused parameters (not the router's "gate.weight")
    renamed = [old for old, new in targets.get(family, {}).items() if "." not in new]
    dropped = [m for m in modules if m.rpartition(".")[2] in renamed and ".experts." not in f".{m}"]
    if dropped:
        more = f" (and {len(dropped) - 1} more)" if len(dropped) > 1 else ""
        raise ConfigError(
            f"peft.target_modules: peft {version} reads a {model_type} adapter as transformers 5's fused "
            f"experts and would drop {dropped[0]}{more} without a word; export with --merge, or leave "
            f"{'/'.join(renamed)} outside the experts out of peft.target_modules")


def _meta(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.to("meta") for k, v in tensors.items()}


def peft_load_report(shell_of: Any, adapter_config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> str | None:
    """What peft's own loader (``get_peft_model`` + ``set_peft_model_state_dict``, as
    ``PeftModel.from_pretrained`` runs them) says of ``tensors`` on a fresh meta model
    from ``shell_of()``: ``None`` when every key lands on a module it adapted and every
    adapted module has its keys, else the first key it would drop or miss."""
    import warnings

    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict

    fields = {k: v for k, v in adapter_config.items() if k not in ("peft_type", "task_type", "base_model_name_or_path")}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # its deprecations; what it drops comes back as keys
            model = get_peft_model(shell_of(), LoraConfig(**fields), low_cpu_mem_usage=True)
            result = set_peft_model_state_dict(model, _meta(tensors), low_cpu_mem_usage=True)
    except Exception as exc:  # noqa: BLE001 - peft refusing the adapter is the answer
        return f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}"
    unexpected = sorted(result.unexpected_keys)
    missing = sorted(k for k in result.missing_keys if ".lora_" in k)
    if unexpected:
        return f"it would not load {unexpected[0]}" + (f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else "")
    if missing:
        return f"it would leave {missing[0]} at its initial value" + (
            f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
    return None


def _shell(folder: str, trust_remote_code: bool) -> nn.Module:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)


def choose_peft_layout(hf_folder: str | None, layouts: dict[str, Any], adapter_config: Any, *,
                       trust_remote_code: bool = False) -> tuple[str, tuple[dict[str, torch.Tensor], list[str]]]:
    """The first of ``layouts`` (name -> a callable giving ``(tensors, modules)``: the keys
    named as the loaded model names its modules, then as the checkpoint does) that peft
    reads back whole onto transformers' model of ``hf_folder``, with its name; else one
    line why not. Without a folder (a first-party model trained from scratch: its names
    are the plugin's tested ones) or without peft installed, the first as it is."""
    names = list(layouts)
    first = layouts[names[0]]()
    path = Path(hf_folder) / "config.json" if hf_folder else None
    if path is None or not path.is_file():
        return names[0], first
    model_type = json.loads(path.read_text()).get("model_type")
    check_peft_reads_back(model_type, first[1])
    try:
        import peft  # noqa: F401
    except ImportError:
        return names[0], first
    try:  # the first attempt's model; peft adds its adapters in place, so each later one builds its own
        spare = [_shell(str(hf_folder), trust_remote_code)]
    except Exception as exc:  # noqa: BLE001 - any failure to build means nothing was checked
        raise ConfigError(f"model.hf={hf_folder}: transformers cannot build its model to check what peft would "
                          f"read ({type(exc).__name__}: {str(exc).splitlines()[0][:160]}); export with --merge"
                          ) from None
    reports = []
    for name in names:
        try:
            tensors, modules = first if name == names[0] else layouts[name]()
        except ConfigError as exc:
            reports.append(str(exc))
            continue
        report = peft_load_report(lambda: spare.pop() if spare else _shell(str(hf_folder), trust_remote_code),
                                  adapter_config(modules), tensors)
        if report is None:
            return name, (tensors, modules)
        reports.append(report)
    raise ConfigError(f"peft.target_modules: peft {_peft_version()} would not read the adapter back onto "
                      f"transformers' {model_type} model: {reports[0]}; export with --merge")


def _peft_version() -> str:
    import peft

    return str(peft.__version__)
