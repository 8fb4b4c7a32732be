"""Hydra glue: the config store, the plugins' search-path entries, composition,
and turning a composed config into a resolved job (flavor + overrides merged).

Hydra runs only in the outer process; ranks read the resolved file with OmegaConf.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from typing import Any

from hydra.core.config_search_path import ConfigSearchPath
from hydra.core.config_store import ConfigStore
from hydra.core.plugins import Plugins
from hydra.plugins.search_path_plugin import SearchPathPlugin
from omegaconf import MISSING, DictConfig, OmegaConf

from titan_plugins.config.schema import JobConfig
from titan_plugins.errors import ConfigError
from titan_plugins.plugins import TitanPluginManager
from titan_plugins.spec import ModelSpec, resolve

CONFIG_MODULE = "titan_plugins.conf"
PRIMARY_CONFIG = "train"
MODEL_META_KEYS = ("name", "flavor")

# Hydra instantiates search-path plugins itself (no arguments), so the entries of
# the current plugin manager are handed over here right before composition.
_SEARCHPATH: list[tuple[str, str]] = []


class TitanSearchPathPlugin(SearchPathPlugin):
    """Adds each plugin's ``conf/`` with its distribution as the provider, so
    ``titan-run --info searchpath`` says where every entry came from."""

    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        for provider, path in _SEARCHPATH:
            search_path.append(provider=provider, path=path)


def _blank_leaves(node: DictConfig) -> None:
    """Set every leaf to ??? : the flavor provides the values, overrides go on top."""
    for key in list(node.keys()):
        child = node._get_node(key)
        if isinstance(child, DictConfig):
            _blank_leaves(child)
        else:
            node[key] = MISSING


def model_schema_node(spec: ModelSpec) -> DictConfig:
    """The typed node stored as ``schema/model/<name>``: the plugin's schema with
    ``name`` and ``flavor`` added and every field left to the flavor."""
    schema = resolve(spec.config)
    if not dataclasses.is_dataclass(schema):
        raise ConfigError(f"model {spec.name!r}: its config schema {schema!r} is not a dataclass")
    choice = dataclasses.make_dataclass(
        f"{schema.__name__}Choice",
        [
            ("name", str, dataclasses.field(default=spec.name)),
            ("flavor", str, dataclasses.field(default=spec.default_flavor)),
        ],
        bases=(schema,),
        kw_only=True,
    )
    node = OmegaConf.structured(choice)
    for key in list(node.keys()):
        if key in MODEL_META_KEYS:
            continue
        child = node._get_node(key)
        if isinstance(child, DictConfig):
            _blank_leaves(child)
        else:
            node[key] = MISSING
    return node


def register_configs(pm: TitanPluginManager) -> None:
    """Fill Hydra's ConfigStore and search path from the plugin manager."""
    cs = ConfigStore.instance()
    cs.store(name="train_schema", node=JobConfig)
    for name, spec in pm.models().items():
        node = model_schema_node(spec)
        cs.store(group="schema/model", name=name, node=node)
        # A fallback option `model=<name>` for plugins that ship no YAML of their own;
        # a plugin's conf/model/<name>.yaml on the search path takes precedence.
        cs.store(group="model", name=name, node=node)
    _SEARCHPATH[:] = pm.searchpath()
    Plugins.instance().register(TitanSearchPathPlugin)


_KEY_RE = re.compile(r"full_key:\s*(\S+)")


def format_config_error(exc: BaseException, overrides: Sequence[str] = ()) -> str:
    """One line naming the key and the value from a Hydra/OmegaConf error."""
    text = str(exc).strip()
    first = text.splitlines()[0] if text else type(exc).__name__
    match = _KEY_RE.search(text)
    key = match.group(1) if match else None
    if key:
        given = next((o for o in overrides if o.lstrip("+~").split("=", 1)[0] == key), None)
        where = given if given else key
        return f"{where}: {first}"
    return first


_PLAN_SWITCH = re.compile(r"^plan=(true|false|True|False)$")


def normalize_overrides(overrides: Sequence[str]) -> list[str]:
    """``plan=true`` is shorthand for ``plan.enabled=true`` (``plan`` is a node, so
    that ``plan.world_size=N`` works beside it)."""
    return [
        f"plan.enabled={m.group(1).lower()}" if (m := _PLAN_SWITCH.match(o)) else o for o in overrides
    ]


def compose(overrides: Sequence[str], pm: TitanPluginManager, *, return_hydra_config: bool = False) -> DictConfig:
    """Compose the job config with Hydra's compose API (no output dir, no run)."""
    overrides = normalize_overrides(overrides)
    from hydra import compose as hydra_compose
    from hydra import initialize_config_module
    from hydra.core.global_hydra import GlobalHydra

    register_configs(pm)
    GlobalHydra.instance().clear()
    try:
        with initialize_config_module(config_module=CONFIG_MODULE, version_base="1.3"):
            return hydra_compose(
                config_name=PRIMARY_CONFIG,
                overrides=list(overrides),
                return_hydra_config=return_hydra_config,
            )
    except ConfigError:
        raise
    except Exception as exc:
        raise ConfigError(format_config_error(exc, overrides)) from exc
    finally:
        GlobalHydra.instance().clear()


def resolve_model(model_node: DictConfig, spec: ModelSpec) -> DictConfig:
    """Merge the chosen flavor with the user's overrides; returns a typed node
    with every field set (name and flavor included)."""
    flavor_name = model_node.get("flavor") or spec.default_flavor
    flavor = spec.flavor(flavor_name)
    schema = resolve(spec.config)
    base = OmegaConf.structured(schema)
    try:
        base = OmegaConf.merge(base, OmegaConf.structured(flavor))
        user = {k: v for k, v in OmegaConf.to_container(model_node, resolve=True, throw_on_missing=False).items()
                if k not in MODEL_META_KEYS}
        merged = OmegaConf.merge(base, user)
    except Exception as exc:
        raise ConfigError(format_config_error(exc)) from exc
    out = OmegaConf.create({"name": spec.name, "flavor": flavor_name})
    return OmegaConf.merge(out, OmegaConf.create(OmegaConf.to_container(merged, resolve=True)))


def model_config(job_model: DictConfig | dict, spec: ModelSpec) -> Any:
    """The schema dataclass instance for a resolved ``model`` node (used on ranks)."""
    schema = resolve(spec.config)
    fields = {k: v for k, v in OmegaConf.to_container(OmegaConf.create(job_model), resolve=True).items()
              if k not in MODEL_META_KEYS}
    try:
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(schema), fields))
    except Exception as exc:
        raise ConfigError(format_config_error(exc)) from exc


def resolve_job(cfg: DictConfig, pm: TitanPluginManager) -> tuple[ModelSpec, DictConfig]:
    """The composed config with its model resolved: what ranks read from disk."""
    if OmegaConf.is_missing(cfg, "model"):
        known = ", ".join(sorted(pm.models())) or "none installed"
        raise ConfigError(f"model is not set: add model=<name> (installed: {known})")
    name = cfg.model.get("name") if isinstance(cfg.model, DictConfig) else None
    spec = pm.get_model(name)
    job = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False))
    job.model = resolve_model(cfg.model, spec)
    return spec, job
