"""Hydra glue: the config store, the plugins' search-path entries, composition,
and turning a composed config into a resolved job (flavor + overrides merged).

Hydra runs only in the outer process; ranks read the resolved file with OmegaConf.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from collections.abc import Sequence
from pathlib import Path
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
MODEL_META_KEYS = ("name", "flavor", "hf")

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
    shipped = _yaml_options(pm, "model")
    for name, spec in pm.models().items():
        node = model_schema_node(spec)
        provider = _provider_of(pm, name)
        cs.store(group="schema/model", name=name, node=node, provider=provider)
        # A fallback option `model=<name>` for plugins that ship no YAML of their own.
        # Stored only then: a ConfigStore entry beside a YAML file of the same name
        # would trigger Hydra's deprecated automatic schema matching.
        if name not in shipped:
            cs.store(group="model", name=name, node=node, provider=provider)
    _SEARCHPATH[:] = pm.searchpath()
    Plugins.instance().register(TitanSearchPathPlugin)


CORE_PROVIDER = "titan-plugins"


def _yaml_options(pm: TitanPluginManager, group: str) -> set[str]:
    """The options of ``group`` that the plugins' search-path entries ship as YAML."""
    found: set[str] = set()
    for _, entry in pm.searchpath():
        try:
            found.update(list_config_options(entry).get(group, []))
        except Exception:
            continue
    return found


def _provider_of(pm: TitanPluginManager, model: str) -> str:
    try:
        info = pm.model_owner(model)
    except Exception:
        return CORE_PROVIDER
    return f"{info.dist} ({info.name})"


# ------------------------------------------------------------------ errors
_KEY_RE = re.compile(r"full_key:\s*(\S+)")
_TYPE_OF_RE = re.compile(r" of type '[^']*'")
_MISSING_OPTION_RE = re.compile(r"Could not find '([^']+)/([^'/]+)'")
_MUST_SPECIFY_RE = re.compile(r"You must specify '([^']+)'")


def _chain(exc: BaseException) -> list[BaseException]:
    out: list[BaseException] = []
    while exc is not None and exc not in out:
        out.append(exc)
        exc = exc.__cause__ or exc.__context__
    return out


def _given(key: str, overrides: Sequence[str]) -> str:
    """The override the user typed for ``key`` (``model.n_layers=abc``), else the key."""
    for override in overrides:
        if override.lstrip("+~").split("=", 1)[0] == key:
            return override.lstrip("+~")
    return key


def _model_error(exc: BaseException, spec: ModelSpec, user: dict) -> ConfigError:
    """A merge error of flavor + overrides, with keys relative to ``model``."""
    node = OmegaConf.create(user)

    def given(key: str) -> str:
        value = OmegaConf.select(node, key.removeprefix("model."), default=None)
        return f"{key}={value}" if value is not None and not isinstance(value, DictConfig) else key

    def keys(key: str) -> list[str]:
        try:
            schema: Any = model_schema_node(spec)
            for part in key.split(".")[1:-1]:
                schema = schema._get_node(part)
            return [str(k) for k in schema.keys()]
        except Exception:
            return []

    line = _typed_error(_chain(exc), given, spec.name, keys, prefix="model.")
    return ConfigError(line or f"model {spec.name!r}: {str(exc).strip().splitlines()[0]}")


def _available_options(text: str, group: str) -> list[str]:
    options: list[str] = []
    collecting = False
    for line in text.splitlines():
        if line.startswith(f"Available options in '{group}'"):
            collecting = True
            continue
        if collecting:
            if line.startswith("\t") or line.startswith("    "):
                options.append(line.strip())
            else:
                break
    return options


def _did_you_mean(word: str, choices: Sequence[str]) -> str:
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.5)
    if not close:
        close = [c for c in sorted(choices) if word and (c.startswith(word) or word in c)][:1]
    return f"; did you mean {close[0]!r}?" if close else ""


def _chosen_model(overrides: Sequence[str]) -> str | None:
    for override in overrides:
        key, sep, value = override.lstrip("+~").partition("=")
        if sep and key == "model":
            return value
    return None


def _schema_keys(key: str, overrides: Sequence[str], pm: TitanPluginManager | None) -> list[str]:
    """The keys the schema allows beside ``key`` (for a "did you mean")."""
    parts = key.split(".")
    try:
        if parts[0] == "model" and len(parts) > 1:
            name = _chosen_model(overrides)
            if pm is None or name is None:
                return []
            node: Any = model_schema_node(pm.get_model(name))
            parts = parts[1:]
        else:
            node = OmegaConf.structured(JobConfig)
        for part in parts[:-1]:
            node = node._get_node(part)
        return [str(k) for k in node.keys()]
    except Exception:
        return []


def _not_in_schema(key: str, given: str, model: str | None, keys: Sequence[str]) -> str:
    parts = key.split(".")
    leaf = parts[-1]
    parent = ".".join(parts[:-1])
    if parts[0] == "model" and len(parts) > 1:
        where = f"the schema of model {model or '?'!r}" + (f" (at {parent})" if parent != "model" else "")
    elif parent:
        where = f"the schema of {parent!r}"
    else:
        where = "the job schema"
    return f"{given}: key {leaf!r} is not in {where}{_did_you_mean(leaf, keys)}"


def _typed_error(
    chain: Sequence[BaseException], given_for: Any, model: str | None, keys_for: Any, prefix: str = ""
) -> str | None:
    """The innermost OmegaConf error that names a key, as one line."""
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException

    for err in reversed(chain):  # innermost first
        if not isinstance(err, OmegaConfBaseException):
            continue
        key = getattr(err, "full_key", None) or (m.group(1) if (m := _KEY_RE.search(str(err))) else None)
        if not key:
            continue
        key = prefix + key
        if isinstance(err, ConfigAttributeError | ConfigKeyError) and "not in" in str(err):
            return _not_in_schema(key, given_for(key), model, keys_for(key))
        first = _TYPE_OF_RE.sub("", str(err).strip().splitlines()[0])
        return f"{given_for(key)}: {first}"
    return None


def format_config_error(
    exc: BaseException, overrides: Sequence[str] = (), pm: TitanPluginManager | None = None
) -> str:
    """One line naming the key and the value, from a Hydra/OmegaConf error.

    Hydra wraps OmegaConf's typed errors (``__cause__``); the innermost error that
    names a ``full_key`` says what was wrong, the override says what was given.
    """
    return str(config_error(exc, overrides, pm))


def config_error(
    exc: BaseException, overrides: Sequence[str] = (), pm: TitanPluginManager | None = None
) -> ConfigError:
    """The ``ConfigError`` (``UnknownModelError`` for an unknown model) to raise
    for a composition error; its message is :func:`format_config_error`'s line."""
    for err in _chain(exc):
        if isinstance(err, ConfigError):
            return err
    if pm is not None:
        from hydra.errors import MissingConfigException

        for err in _chain(exc):
            match = _MISSING_OPTION_RE.search(str(err)) if isinstance(err, MissingConfigException) else None
            if match and match.group(1) == "model":
                try:
                    pm.get_model(match.group(2))
                except ConfigError as unknown:
                    return unknown
    return ConfigError(_format(exc, overrides, pm))


def _format(exc: BaseException, overrides: Sequence[str], pm: TitanPluginManager | None) -> str:
    from hydra.errors import MissingConfigException, OverrideParseException

    chain = _chain(exc)
    for err in chain:
        if match := _MUST_SPECIFY_RE.search(str(err)):
            group = match.group(1)
            if group == "model":
                known = ", ".join(sorted(pm.models())) if pm is not None else ""
                return f"model is not set: add model=<name> (installed: {known or 'none'})"
            return f"{group} is not set: add {group}=<option>"
    for err in chain:
        if isinstance(err, MissingConfigException):
            text = str(err)
            if match := _MISSING_OPTION_RE.search(text):
                group, option = match.group(1), match.group(2)
                if group == "model" and pm is not None:
                    try:
                        pm.get_model(option)
                    except ConfigError as unknown:
                        return str(unknown)
                options = _available_options(text, group)
                hint = _did_you_mean(option, options)
                return (f"{group}={option}: no such preset{hint} "
                        f"(available: {', '.join(options) or 'none'})")
        if isinstance(err, OverrideParseException):
            lines = [ln.strip() for ln in str(err).splitlines()
                     if ln.strip() and not ln.startswith("See https")]
            return "cannot parse the override: " + "; ".join(lines)
    line = _typed_error(
        chain,
        lambda key: _given(key, overrides),
        _chosen_model(overrides),
        lambda key: _schema_keys(key, overrides, pm),
    )
    if line:
        return line
    text = str(exc).strip()
    first = text.splitlines()[0] if text else type(exc).__name__
    match = _KEY_RE.search(text)
    if match:
        return f"{_given(match.group(1), overrides)}: {first}"
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
        raise config_error(exc, overrides, pm) from exc
    finally:
        GlobalHydra.instance().clear()


def _without_missing(tree: Any) -> Any:
    """Drop ``???`` leaves: what the flavor provides stays the flavor's."""
    if isinstance(tree, dict):
        return {k: _without_missing(v) for k, v in tree.items() if v != "???"}
    return tree


def resolve_model(model_node: DictConfig, spec: ModelSpec) -> DictConfig:
    """Merge the chosen flavor with the user's overrides; returns a typed node
    with every field set (name and flavor included)."""
    flavor_name = model_node.get("flavor") or spec.default_flavor
    flavor = spec.flavor(flavor_name)
    schema = resolve(spec.config)
    base = OmegaConf.structured(schema)
    user = _without_missing(
        {k: v for k, v in OmegaConf.to_container(model_node, resolve=True, throw_on_missing=False).items()
         if k not in MODEL_META_KEYS}
    )
    hf = model_node.get("hf")
    try:
        base = OmegaConf.merge(base, OmegaConf.structured(flavor))
        if hf:  # config.json on top of the flavor, the user's overrides on top of it
            from titan_plugins.hf.config import hf_model_values

            base = OmegaConf.merge(base, hf_model_values(spec, hf))
        merged = OmegaConf.merge(base, user)
    except ConfigError:
        raise
    except Exception as exc:
        raise _model_error(exc, spec, user) from exc
    hf = str(Path(hf).resolve()) if hf else None  # ranks may start elsewhere
    out = OmegaConf.create({"name": spec.name, "flavor": flavor_name, "hf": hf})
    return OmegaConf.merge(
        out, OmegaConf.create(OmegaConf.to_container(merged, resolve=True, enum_to_str=True))
    )


def model_config(job_model: DictConfig | dict, spec: ModelSpec) -> Any:
    """The schema dataclass instance for a resolved ``model`` node (used on ranks)."""
    schema = resolve(spec.config)
    fields = {k: v for k, v in OmegaConf.to_container(OmegaConf.create(job_model), resolve=True).items()
              if k not in MODEL_META_KEYS}
    try:
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(schema), fields))
    except Exception as exc:
        raise _model_error(exc, spec, fields) from exc


def resolve_job(cfg: DictConfig, pm: TitanPluginManager) -> tuple[ModelSpec, DictConfig]:
    """The composed config with its model resolved: what ranks read from disk."""
    if OmegaConf.is_missing(cfg, "model"):
        known = ", ".join(sorted(pm.models())) or "none installed"
        raise ConfigError(f"model is not set: add model=<name> (installed: {known})")
    name = cfg.model.get("name") if isinstance(cfg.model, DictConfig) else None
    spec = pm.get_model(name)
    job = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False))
    job.model = resolve_model(cfg.model, spec)
    if job.model.get("hf") and not job.data.get("tokenizer"):  # the folder's tokenizer.json
        from titan_plugins.hf.config import tokenizer_path

        if tokenizer_path(job.model.hf) is not None:
            job.data.tokenizer = job.model.hf
    return spec, job


def _conf_root(entry: str) -> Any:
    """A traversable for a search-path entry (``pkg://a.conf`` or ``file:///dir``)."""
    import importlib.resources
    from pathlib import Path

    scheme, _, rest = entry.partition("://")
    if scheme == "pkg":
        return importlib.resources.files(rest.replace("/", "."))
    if scheme == "file":
        return Path(rest)
    raise ValueError(f"unsupported search-path entry {entry!r}")


def list_config_options(entry: str) -> dict[str, list[str]]:
    """``{group: [option, ...]}`` for the YAML files under one search-path entry
    (nested groups as ``a/b``); the primary config at the root is not a group."""
    groups: dict[str, list[str]] = {}

    def walk(node: Any, prefix: str) -> None:
        for child in sorted(node.iterdir(), key=lambda c: c.name):
            if child.is_dir() and not child.name.startswith(("_", ".")):
                walk(child, f"{prefix}{child.name}/")
            elif prefix and child.name.endswith((".yaml", ".yml")):
                groups.setdefault(prefix.rstrip("/"), []).append(child.name.rsplit(".", 1)[0])

    root = _conf_root(entry)
    if root.is_dir():
        walk(root, "")
    return groups


def config_options(pm: TitanPluginManager) -> dict[str, dict[str, str]]:
    """Every option of every config group: ``{group: {option: provider}}``, from the
    core's tree, each plugin's search-path entries and the models in the registry."""
    options: dict[str, dict[str, str]] = {}
    sources = [(CORE_PROVIDER, f"pkg://{CONFIG_MODULE}"), *pm.searchpath()]
    for provider, entry in sources:
        try:
            found = list_config_options(entry)
        except Exception:
            continue  # a broken entry shows up when Hydra composes
        for group, names in found.items():
            for name in names:
                options.setdefault(group, {}).setdefault(name, provider)
    for name in pm.models():
        options.setdefault("model", {}).setdefault(name, _provider_of(pm, name))
    return {group: dict(sorted(opts.items())) for group, opts in sorted(options.items())}
