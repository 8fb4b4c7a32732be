"""What the config tree offers: the options of each group in the core's ``conf/``,
in the plugins' search-path entries and in the model registry, with the
distribution that provides each (``titan-run --help``, ``titan-plugins list``).
"""

from __future__ import annotations

import importlib.resources
from pathlib import Path
from typing import Any

from titan_plugins.plugins import TitanPluginManager

CONFIG_MODULE = "titan_plugins.conf"
PRIMARY_CONFIG = "train"
CORE_PROVIDER = "titan-plugins"

# What reading a search-path entry can raise: an unsupported scheme (ValueError),
# a package that is not installed (ImportError), an unreadable folder (OSError).
# Such an entry is left out of listings; Hydra reports it when it composes.
UNREADABLE_ENTRY = (ValueError, ImportError, OSError)


def provider_of(pm: TitanPluginManager, model: str) -> str:
    """``"dist (plugin)"`` for a registered model: the provider Hydra shows."""
    info = pm.model_owner(model)
    return f"{info.dist} ({info.name})"


def _conf_root(entry: str) -> Any:
    """A traversable for a search-path entry (``pkg://a.conf`` or ``file:///dir``)."""
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


def _readable_options(entry: str) -> dict[str, list[str]]:
    try:
        return list_config_options(entry)
    except UNREADABLE_ENTRY:
        return {}


def yaml_options(pm: TitanPluginManager, group: str) -> set[str]:
    """The options of ``group`` that the plugins' search-path entries ship as YAML."""
    found: set[str] = set()
    for _, entry in pm.searchpath():
        found.update(_readable_options(entry).get(group, []))
    return found


def config_options(pm: TitanPluginManager) -> dict[str, dict[str, str]]:
    """Every option of every config group: ``{group: {option: provider}}``, from the
    core's tree, each plugin's search-path entries and the models in the registry."""
    options: dict[str, dict[str, str]] = {}
    sources = [(CORE_PROVIDER, f"pkg://{CONFIG_MODULE}"), *pm.searchpath()]
    for provider, entry in sources:
        for group, names in _readable_options(entry).items():
            for name in names:
                options.setdefault(group, {}).setdefault(name, provider)
    for name in pm.models():
        options.setdefault("model", {}).setdefault(name, provider_of(pm, name))
    return {group: dict(sorted(opts.items())) for group, opts in sorted(options.items())}
