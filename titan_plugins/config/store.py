"""What Hydra sees of the plugins: each model's typed schema in the ConfigStore
(``schema/model/<name>``, and ``model/<name>`` for a plugin without YAML of its
own) and each plugin's ``conf/`` on the search path, provider named."""

from __future__ import annotations

import dataclasses

from hydra.core.config_search_path import ConfigSearchPath
from hydra.core.config_store import ConfigStore
from hydra.core.plugins import Plugins
from hydra.plugins.search_path_plugin import SearchPathPlugin
from omegaconf import MISSING, DictConfig, OmegaConf

from titan_plugins.config.options import CORE_PROVIDER, provider_of, yaml_options
from titan_plugins.config.schema import JobConfig
from titan_plugins.errors import ConfigError
from titan_plugins.plugins import TitanPluginManager
from titan_plugins.spec import ModelSpec, resolve

# The keys of the ``model`` node that choose a model; every other key is its config.
MODEL_META_KEYS = ("name", "flavor", "hf", "hf_partial", "verify", "verified")

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
            ("hf", str | None, dataclasses.field(default=None)),  # a Hugging Face model folder
            # load a part of model.hf (fewer layers than the folder's) on purpose
            ("hf_partial", bool, dataclasses.field(default=False)),
            # check model.hf against the plugin's reference before launch (ModelSpec.verify):
            # null = the plugin decides (on for architectures it has not proven), true, false
            ("verify", bool | None, dataclasses.field(default=None)),
            ("verified", str | None, dataclasses.field(default=None)),  # set by the check: the header's line
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


def _forget_group(cs: ConfigStore, group: str) -> None:
    """Drop what an earlier manager stored in ``group`` (the ConfigStore is a
    process-wide singleton; each composition reflects only the current manager)."""
    *parents, leaf = group.split("/")
    node = cs.repo
    for part in parents:
        node = node.get(part, {})
    if isinstance(node, dict):
        node.pop(leaf, None)


def register_configs(pm: TitanPluginManager) -> None:
    """Fill Hydra's ConfigStore and search path from the plugin manager."""
    from titan_plugins.run_dir import register_resolver

    register_resolver()  # ${titan_claim:...}: the default run directories (train.yaml)
    cs = ConfigStore.instance()
    cs.store(name="train_schema", node=JobConfig, provider=CORE_PROVIDER)
    _forget_group(cs, "schema/model")
    _forget_group(cs, "model")
    shipped = yaml_options(pm, "model")
    for name, spec in pm.models().items():
        node = model_schema_node(spec)
        provider = provider_of(pm, name)
        cs.store(group="schema/model", name=name, node=node, provider=provider)
        # A fallback option `model=<name>` for plugins that ship no YAML of their own.
        # Stored only then: a ConfigStore entry beside a YAML file of the same name
        # would trigger Hydra's deprecated automatic schema matching.
        if name not in shipped:
            cs.store(group="model", name=name, node=node, provider=provider)
    _SEARCHPATH[:] = pm.searchpath()
    Plugins.instance().register(TitanSearchPathPlugin)
