"""Which modules ``peft.target_modules`` names.

A pattern matches a module's fully qualified name when it is the name, a dotted
suffix of it (``wq`` matches ``layers.0.attention.wq``) or a glob over either
(``layers.*.attention.w[qkv]``). Only ``nn.Linear`` modules (and subclasses) are
adapted. A pattern that matches no ``nn.Linear`` is one error line naming a few that
exist; one that reaches grouped MoE expert weights (3-D parameters, not
``nn.Linear``) is refused in one line.

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

from titan_plugins.errors import ConfigError
from titan_plugins.peft.config import ALL_LINEAR

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
    """FQNs of the ``nn.Linear`` modules of ``model`` that ``patterns`` name, in
    module order. ``exclude`` lists top-level modules ``all-linear`` leaves out
    (those only on the first or last pipeline stage: the output projection)."""
    patterns = [str(p) for p in patterns]
    if not patterns:
        raise ConfigError("peft.target_modules=[]: name at least one module pattern (or all-linear)")
    modules = [(canonical_name(n), m) for n, m in model.named_modules() if n and m is not None]
    linears = [n for n, m in modules if isinstance(m, nn.Linear)]
    uncalled = _uncalled(model)
    chosen: set[str] = set()
    for pattern in patterns:
        if pattern == ALL_LINEAR:
            chosen |= {n for n in linears if n.split(".")[0] not in exclude and n not in uncalled}
            continue
        _refuse_experts(model, pattern)
        hits = [n for n in linears if matches(n, pattern)]
        named = [n for n in hits if n in uncalled]
        if named:
            raise ConfigError(
                f"peft.target_modules={pattern}: names {_shape_name(named[0])}, whose weight its "
                f"{uncalled[named[0]]} reads without calling it, so an adapter there would never "
                "train; leave it out (all-linear does)"
            )
        if not hits:
            others = [f"{n} ({type(m).__name__})" for n, m in modules if matches(n, pattern)]
            what = f"matches {others[0]}, not an nn.Linear" if others else "matches no module"
            raise ConfigError(
                f"peft.target_modules={pattern}: {what}; nn.Linear modules here: {_few(linears)}"
            )
        chosen.update(hits)
    if not chosen:
        raise ConfigError(f"peft.target_modules={list(patterns)}: the model has no nn.Linear to adapt")
    return [n for n in linears if n in chosen]


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


def _refuse_experts(model: nn.Module, pattern: str) -> None:
    """Grouped expert weights (``[experts, out, in]`` parameters of a non-Linear
    module) are not ``nn.Linear``: a pattern naming them is refused, not skipped."""
    for name, param in model.named_parameters():
        name = canonical_name(name)
        owner = name.rsplit(".", 1)[0]
        if param.ndim >= 3 and (matches(name, pattern) or matches(owner, pattern)):
            raise ConfigError(
                f"peft.target_modules={pattern}: names the grouped MoE expert weights {_shape_name(name)}, "
                "which LoRA does not adapt (not nn.Linear); target the attention, shared-expert "
                "or dense projections"
            )
