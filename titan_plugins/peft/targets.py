"""Which modules ``peft.target_modules`` names.

A pattern matches a module's fully qualified name when it is the name, a dotted
suffix of it (``wq`` matches ``layers.0.attention.wq``) or a glob over either
(``layers.*.attention.w[qkv]``). ``nn.Linear`` modules (and subclasses) are adapted,
and the grouped MoE expert weights of ``components.moe.GroupedExperts`` (``w1``/``w2``/
``w3``, ``[E, out, in]``; ``peft/experts.py``) when a pattern names the weight
(``experts.w1``) or its experts module (``experts``); ``all-linear`` leaves them out.
A pattern that matches neither is one error line naming a few that exist; one that
reaches other 3-D weights (a plugin's own expert module) is refused in one line.

A module whose ancestor reads its ``weight`` instead of calling it (the MoE router's
``gate`` and the shared experts: ``F.linear(x, w)`` in the MoE forward) would never
run its adapter. Such an ancestor lists it, by its path below, in a class attribute
(``lora_uncalled = ("router.gate", "shared_experts.w1", ...)``): ``all-linear`` leaves
it out and a pattern naming it is refused in one line.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from fnmatch import fnmatchcase

from torch import nn

from titan_plugins.components.moe.experts import GroupedExperts
from titan_plugins.errors import ConfigError
from titan_plugins.peft.config import ALL_LINEAR
from titan_plugins.peft.experts import EXPERT_WEIGHTS

__all__ = ["canonical_name", "match_targets", "matches"]

# Wrapper prefixes that torch inserts into module names (compile, activation
# checkpointing, FSDP1): the state-dict key of a parameter drops them.
_WRAPPERS = ("_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module.")


def canonical_name(name: str) -> str:
    """``name`` without torch's wrapper components (the model's own FQN)."""
    for wrapper in _WRAPPERS:
        name = name.replace(wrapper, "")
    return name


def matches(name: str, pattern: str) -> bool:
    """Whether the module FQN ``name`` is named by ``pattern`` (module docstring)."""
    if name == pattern or name.endswith("." + pattern):
        return True
    return fnmatchcase(name, pattern) or fnmatchcase(name, "*." + pattern)


def _shape_name(name: str) -> str:
    """``layers.3.attention.wq`` -> ``layers.*.attention.wq`` (one entry per kind)."""
    return re.sub(r"\.\d+(?=\.|$)", ".*", name)


def _few(names: Iterable[str], limit: int = 8) -> str:
    kinds = list(dict.fromkeys(_shape_name(n) for n in names))
    more = f", ... ({len(kinds) - limit} more)" if len(kinds) > limit else ""
    return ", ".join(kinds[:limit]) + more


def match_targets(model: nn.Module, patterns: Sequence[str], exclude: Sequence[str] = ()) -> list[str]:
    """What ``patterns`` name in ``model``, in module order: FQNs of ``nn.Linear``
    modules and of grouped expert weights (``layers.0.moe.experts.w1``). ``exclude``
    lists top-level modules ``all-linear`` leaves out (those only on the first or last
    pipeline stage: the output projection)."""
    patterns = [str(p) for p in patterns]
    if not patterns:
        raise ConfigError("peft.target_modules=[]: name at least one module pattern (or all-linear)")
    modules = [(canonical_name(n), m) for n, m in model.named_modules() if n and m is not None]
    linears = [n for n, m in modules if isinstance(m, nn.Linear)]
    not_maps = {n: why for n, m in modules if isinstance(m, nn.Linear) and (why := _not_a_linear_map(m))}
    experts = [f"{n}.{w}" for n, m in modules if isinstance(m, GroupedExperts) for w in EXPERT_WEIGHTS]
    uncalled = _uncalled(model)
    chosen: set[str] = set()
    for pattern in patterns:
        if pattern == ALL_LINEAR:
            chosen |= {n for n in linears if n.split(".")[0] not in exclude and n not in uncalled and n not in not_maps}
            continue
        _refuse_other_grouped(model, pattern)
        hits = [n for n in linears if matches(n, pattern)]
        named = [n for n in hits if n in uncalled]
        if named:
            raise ConfigError(
                f"peft.target_modules={pattern}: names {_shape_name(named[0])}, whose weight its "
                f"{uncalled[named[0]]} reads without calling it, so an adapter there would never "
                "train; leave it out (all-linear does)"
            )
        odd = [n for n in hits if n in not_maps]
        if odd:
            raise ConfigError(
                f"peft.target_modules={pattern}: names {_shape_name(odd[0])}, an nn.Linear whose own forward "
                f"returns {not_maps[odd[0]]}, not the linear map an adapter adds to; leave it out (all-linear does)"
            )
        hits += [n for n in experts if matches(n, pattern) or matches(n.rpartition(".")[0], pattern)]
        if not hits:
            others = [f"{n} ({type(m).__name__})" for n, m in modules if matches(n, pattern)]
            what = f"matches {others[0]}, not an nn.Linear" if others else "matches no module"
            grouped = f"; grouped expert weights: {_few(experts)}" if experts else ""
            raise ConfigError(
                f"peft.target_modules={pattern}: {what}; nn.Linear modules here: {_few(linears)}{grouped}"
            )
        chosen.update(hits)
    if not chosen:
        raise ConfigError(f"peft.target_modules={list(patterns)}: the model has no nn.Linear to adapt")
    order = [n for name, m in modules if isinstance(m, (nn.Linear, GroupedExperts))
             for n in ([name] if isinstance(m, nn.Linear) else [f"{name}.{w}" for w in EXPERT_WEIGHTS])]
    return [n for n in order if n in chosen]


def _not_a_linear_map(module: nn.Linear) -> str | None:
    """What a subclass of ``nn.Linear`` with a forward of its own returns when that is not
    one ``[..., out_features]`` tensor (PhiMoE's router: a tuple of scores and picks), so
    a LoRA delta cannot be added to it; ``None`` for a linear map (or a forward that does
    not run on one zero row, which is left to the model). One row, on the module's device:
    nothing is computed on the meta device."""
    if type(module).forward is nn.Linear.forward or hasattr(module, "lora_A"):
        return None
    import torch

    weight = module.weight
    try:
        with torch.no_grad():
            out = module(torch.zeros(1, module.in_features, device=weight.device, dtype=weight.dtype))
    except Exception:  # noqa: BLE001 - not ours to judge: the model's own forward decides
        return None
    if isinstance(out, torch.Tensor):
        return None if out.shape[-1] == module.out_features else f"a tensor of shape {tuple(out.shape)}"
    return f"a {type(out).__name__}"


def _uncalled(model: nn.Module) -> dict[str, str]:
    """``{FQN: parent class}`` of the children their parents list in ``lora_uncalled``."""
    out: dict[str, str] = {}
    for name, module in model.named_modules():
        for child in getattr(type(module), "lora_uncalled", ()):
            try:
                module.get_submodule(child)
            except AttributeError:  # an optional child (no shared experts)
                continue
            out.setdefault(canonical_name(f"{name}.{child}" if name else child), type(module).__name__)
    return out


def _refuse_other_grouped(model: nn.Module, pattern: str) -> None:
    """3-D weights of a module that is not ``GroupedExperts`` (a plugin's own expert
    layout, whose forward LoRA cannot reach): a pattern naming them is refused, not skipped."""
    for raw, param in model.named_parameters():
        if param.ndim < 3 or ".lora_" in raw:
            continue
        module = model.get_submodule(raw.rpartition(".")[0])
        name = canonical_name(raw)
        named = matches(name, pattern) or matches(name.rpartition(".")[0], pattern)
        if named and not isinstance(module, GroupedExperts):
            raise ConfigError(
                f"peft.target_modules={pattern}: names the grouped weights {_shape_name(name)} of "
                f"{type(module).__name__}, which LoRA does not adapt (only nn.Linear and "
                "titan_plugins.components.moe.GroupedExperts); leave them out"
            )
