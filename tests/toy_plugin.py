"""A tiny plugin for the core's tests: a dataclass schema, two flavors, no torch.

Tests register it in a manager they own (``pm.add_plugin(toy_plugin)``); nothing
is installed. ``make_plugin`` builds variants (other names, broken ones).
"""

from __future__ import annotations

import types
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from titan_plugins import Capabilities, DatasetSpec, ModelSpec, hookimpl

TITAN_PLUGINS_API = ">=1.0,<2"


class Activation(str, Enum):
    silu = "silu"
    gelu = "gelu"


@dataclass(kw_only=True)
class ToyMoE:
    num_experts: int = 4
    top_k: int = 1


@dataclass(kw_only=True)
class ToyConfig:
    dim: int = 16
    n_layers: int = 2
    n_heads: int = 2
    vocab_size: int = 64
    norm_eps: float = 1e-5
    activation: Activation = Activation.silu
    moe: ToyMoE = field(default_factory=ToyMoE)


FLAVORS = {
    "debugmodel": ToyConfig(dim=16, n_layers=2, n_heads=2),
    "wide": ToyConfig(dim=64, n_layers=2, n_heads=4, moe=ToyMoE(num_experts=8, top_k=2)),
}


def build(config: ToyConfig) -> Any:  # never called by the core's config tests
    raise NotImplementedError


def spec(name: str = "toy", **overrides: Any) -> ModelSpec:
    values: dict[str, Any] = dict(
        name=name,
        config=ToyConfig,
        flavors=FLAVORS,
        build=build,
        parallelize=build,
        capabilities=Capabilities(fsdp=True, tp=True),
        description="a toy model for the core's tests",
    )
    values.update(overrides)
    return ModelSpec(**values)


@hookimpl
def titan_register_models(register: Any) -> None:
    register(spec("toy"))


@hookimpl
def titan_register_datasets(register: Any) -> None:
    register(DatasetSpec(name="toy_data", build=build, description="toy tokens"))


def make_plugin(module_name: str, *, models: tuple[str, ...] = ("toy",), **extra: Any) -> types.ModuleType:
    """A fresh plugin module registering ``models`` (plus any ``extra`` attributes)."""
    mod = types.ModuleType(module_name)

    @hookimpl
    def titan_register_models(register: Any) -> None:
        for model in models:
            register(spec(model))

    mod.titan_register_models = titan_register_models
    for key, value in extra.items():
        setattr(mod, key, value)
    return mod
