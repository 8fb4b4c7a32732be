"""``peft=lora`` / ``qlora`` checked before any rank starts (``train/api.py``'s ``validate_job``).

The model is built once on the meta device: LoRA applied (its target patterns, float8 and
QLoRA limits raise their one line there). With ``peft.init_from=DIR`` the PEFT adapter folder
is then read as the ranks would read it, without loading a tensor (``peft/folder.py``):

- ``adapter_config.json``: readable, LoRA, ``r`` / ``lora_alpha`` the run's;
- ``adapter_model.safetensors``: its header opened with the safetensors library (a damaged
  or truncated file is one line with the library's reason);
- the modules the adapter targets (``target_modules`` in its config, the modules of its
  tensors) exist in the model, under the Hugging Face names of the plugin's ``to_hf``
  applied to the meta model's state dict: the ones that do not are named;
- every pair the run reads is there at the run's shapes (``[r, in]``, ``[out, r]``), and
  nothing else: a file saved for another model's shapes is one line naming the tensor.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from titan_plugins.errors import ConfigError
from titan_plugins.peft.folder import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    PEFT_PREFIX,
    Pair,
    adapter_pairs,
    check_stored,
    read_adapter_config,
    stored_shapes,
)

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from titan_plugins.spec import ModelSpec

__all__ = ["check_lora"]

_PAIR_KEY = re.compile(r"(.+)\.lora_[AB]\.weight")


def check_lora(spec: ModelSpec, job: DictConfig, config: Any) -> None:
    """The run's LoRA on the meta model, and ``peft.init_from``'s folder (module docstring)."""
    from titan_plugins.model.lifecycle import apply_peft, build_meta_model
    from titan_plugins.peft.experts import GroupedLoRA
    from titan_plugins.peft.lora import adapter_modules, is_adapter_key

    model = build_meta_model(spec, job)
    base = dict(model.state_dict())  # meta tensors, before the adapters join
    apply_peft(model, spec, job)
    folder = job.peft.get("init_from")
    if not folder:
        return
    adapter_cfg = read_adapter_config(folder, job.peft)
    stored = stored_shapes(folder)
    shapes = {name: m.shape if isinstance(m, GroupedLoRA) else (m.out_features, m.in_features)
              for name, m in adapter_modules(model)}
    pairs = adapter_pairs(spec, config, shapes, job.model.get("hf"), stored)
    base = {k: v for k, v in base.items() if not is_adapter_key(k)}
    check_targets(folder, adapter_cfg, stored, pairs, _hf_modules(spec, config, base, job.model.get("hf")))
    check_stored(folder, stored, pairs, int(job.peft.rank))


def check_targets(folder: str, adapter_cfg: dict, stored: dict[str, Any], pairs: list[Pair],
                  modules: dict[str, int] | None) -> None:
    """The adapter's ``target_modules`` and its tensors' modules are modules of the model
    (``modules``: its Hugging Face module names and their weight's ``ndim``, ``None`` when
    unknown: not checked)."""
    if modules is None:
        return
    readable = {p.a[len(PEFT_PREFIX): -len(".lora_A.weight")] for p in pairs}  # never refused
    known = set(modules) | readable
    names = _with_ancestors(known)
    missing: list[str] = []
    targets = adapter_cfg.get("target_modules")
    if isinstance(targets, str) and targets != "all-linear":  # peft: a regex over full names
        try:
            if not any(re.fullmatch(targets, n) for n in names):
                missing.append(targets)
        except re.error:
            raise ConfigError(f"peft.init_from={folder}: {ADAPTER_CONFIG} target_modules={targets!r} "
                              "is not a regular expression") from None
    elif isinstance(targets, list):  # peft: a name or a dotted suffix of one
        missing += [str(t) for t in targets
                    if not any(n == t or n.endswith(f".{t}") for n in names)]
    if missing:
        raise ConfigError(
            f"peft.init_from={folder}: {ADAPTER_CONFIG} targets modules the model does not have: "
            f"{', '.join(missing)} (the model's: {_leaves(modules)})")
    foreign = []
    for key in stored:
        match = _PAIR_KEY.fullmatch(key)
        module = match.group(1).removeprefix(PEFT_PREFIX) if match else None
        if module is not None and module not in known:
            foreign.append(_kind(module))
    if foreign:
        kinds = list(dict.fromkeys(foreign))
        raise ConfigError(
            f"peft.init_from={folder}: {ADAPTER_WEIGHTS} holds adapters for modules the model does not have: "
            f"{', '.join(kinds[:4])}{', ...' if len(kinds) > 4 else ''} (the model's: {_leaves(modules)})")


def _hf_modules(spec: ModelSpec, config: Any, base: dict[str, Any], hf_folder: str | None) -> dict[str, int] | None:
    """The model's modules under Hugging Face names, with their weight's ``ndim``: ``to_hf``
    of the meta state dict, or None where the plugin's adapter cannot map meta tensors."""
    from titan_plugins.peft.mapping import state_dict_adapter

    adapter = state_dict_adapter(spec, config, hf_folder)
    try:
        hf = adapter.to_hf(base)
    except Exception:  # noqa: BLE001 - a plugin's to_hf that needs real values
        return None
    return {k.removesuffix(".weight"): v.ndim for k, v in hf.items() if k.endswith(".weight")} or None


def _with_ancestors(modules: set[str]) -> set[str]:
    out = set()
    for name in modules:
        parts = name.split(".")
        out.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    return out


def _kind(name: str) -> str:
    """``model.layers.3.self_attn.q_proj`` -> ``model.layers.*.self_attn.q_proj``."""
    return re.sub(r"\.\d+(?=\.|$)", ".*", name)


def _leaves(modules: dict[str, int], limit: int = 10) -> str:
    """The leaf names of the modules a LoRA adapter could sit on (a 2-D weight or more)."""
    leaves = sorted({m.rpartition(".")[2] for m, ndim in modules.items() if ndim >= 2})
    return ", ".join(leaves[:limit]) + (", ..." if len(leaves) > limit else "")
