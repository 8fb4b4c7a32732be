"""The objectives a run can choose: the core's own (sft, dpo, grpo) and those of installed
distributions under the entry-point group ``titan_plugins.objectives``.

Discovery mirrors the model plugins' (``titan_plugins.plugins``): each entry point is
loaded in its own try/except, so a broken one is one line naming it and its
distribution, and never hides the others; two claiming one name is an error naming
both. A run is strict (any failure stops it before launch); listing is lenient.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from titan_plugins.errors import ConfigError
from titan_plugins.objectives.spec import DataKind, ObjectiveSpec
from titan_plugins.spec import resolve
from titan_plugins.suggest import did_you_mean

__all__ = ["BUILTIN_OBJECTIVES", "ENTRY_POINT_GROUP", "ObjectiveRegistry", "build_objective", "discover"]

ENTRY_POINT_GROUP = "titan_plugins.objectives"
CORE = "titan-plugins"

BUILTIN_OBJECTIVES = (
    ObjectiveSpec(
        name="sft",
        build="titan_plugins.objectives.sft:SFTObjective",
        description="next-token cross-entropy over the labelled tokens of the global batch (the default)",
    ),
    ObjectiveSpec(
        name="dpo",
        build="titan_plugins.objectives.dpo:DPOObjective",
        data=DataKind.pairs,
        needs_reference=True,
        description="preference pairs: DPO (sigmoid, ipo, hinge, robust) and the reference-free simpo, orpo",
    ),
    ObjectiveSpec(
        name="grpo",
        build="titan_plugins.objectives.grpo:GRPOObjective",
        data=DataKind.prompts,
        description="online RL on prompts: completions sampled each step (rollout=native|file), scored by rewards "
        "(titan_plugins.rewards); grpo, dapo, dr_grpo, bnpo, GSPO",
    ),
)


@dataclass
class ObjectiveRegistry:
    """name -> spec, where each came from (``dist==version``), and the load failures."""

    specs: dict[str, ObjectiveSpec] = field(default_factory=dict)
    origins: dict[str, str] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)

    def add(self, spec: Any, origin: str) -> None:
        if not isinstance(spec, ObjectiveSpec):
            self.errors.append(f"objective entry point from {origin} is a {type(spec).__name__}, "
                               "not a titan_plugins.objectives.ObjectiveSpec")
            return
        if spec.name in self.specs:
            self.errors.append(f"objective {spec.name!r} is registered by both {self.origins[spec.name]} "
                               f"and {origin}")
            return
        self.specs[spec.name] = spec
        self.origins[spec.name] = origin

    def get(self, name: str) -> ObjectiveSpec:
        if name in self.specs:
            return self.specs[name]
        clash = next((e for e in self.errors if f"objective {name!r} " in e), None)
        raise ConfigError(clash or (
            f"objective.name={name} is not a known objective{did_you_mean(name, self.specs)} "
            f"(installed: {', '.join(sorted(self.specs))})"))

    def raise_on_errors(self) -> None:
        if self.errors:
            more = f" (and {len(self.errors) - 1} more)" if len(self.errors) > 1 else ""
            raise ConfigError(self.errors[0] + more)


def _entry_points() -> Iterator[tuple[Any, str]]:
    """``(entry_point, "dist==version")`` for every installed objective."""
    from titan_plugins.plugins import _dist_name_version, iter_entry_points

    for ep, dist in iter_entry_points(ENTRY_POINT_GROUP):
        name, version = _dist_name_version(dist)
        yield ep, f"{name}=={version}"


def discover(entry_points: Iterable[tuple[Any, str]] | None = None) -> ObjectiveRegistry:
    """The built-in objectives, then every entry point (``[(entry_point, "dist==ver")]``
    replaces discovery in tests). ``TITAN_PLUGINS_BLOCK`` names blocked ones too."""
    from titan_plugins.plugins import ENV_BLOCK, _env_list

    reg = ObjectiveRegistry()
    from titan_plugins import __version__

    for spec in BUILTIN_OBJECTIVES:
        reg.add(spec, f"{CORE}=={__version__}")
    block = _env_list(ENV_BLOCK) or set()
    for ep, origin in entry_points if entry_points is not None else _entry_points():
        if ep.name in block:
            continue
        try:
            spec = ep.load()
        except Exception as exc:  # a broken objective must not take the others down
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            reg.errors.append(f"objective {ep.name!r} ({ep.value}) from {origin} failed to load: "
                              f"{type(exc).__name__}: {first}")
            continue
        if isinstance(spec, ObjectiveSpec) and spec.name != ep.name:
            reg.errors.append(f"objective entry point {ep.name!r} from {origin} registers the name "
                              f"{spec.name!r}; the two must agree")
            continue
        reg.add(spec, origin)
    return reg


def build_objective(objective_config: Any, registry: ObjectiveRegistry | None = None) -> Any:
    """The ``Objective`` instance ``objective.name`` names, built from its config."""
    reg = registry or discover()
    reg.raise_on_errors()  # a run is strict: a broken objective package stops it
    spec = reg.get(str(getattr(objective_config, "name", None) or "sft"))
    cls = resolve(spec.build)
    objective = cls(objective_config, spec)
    if getattr(objective_config, "precompute_ref", False) and not objective.needs_reference:
        raise ConfigError(f"objective.precompute_ref=true: {objective.describe()} uses no reference model, "
                          "so there is nothing to precompute")
    return objective
