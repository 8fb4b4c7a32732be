"""Where plugins come from and whether they may load, decided before a plugin module
runs: the entry-point walk (each entry point attributed to its distribution), the
environment switches (allow, block, extra modules, tracing) and the plugin API range,
read from a module's source without importing it.

The plugin manager (``titan_plugins.plugins``) loads what this finds; the objectives'
registry walks its own entry-point group with the same functions. Imports neither
pluggy nor torch. Plugin authors and tools import these names from
``titan_plugins.plugins``, which re-exports them.
"""

from __future__ import annotations

import ast
import importlib.metadata as metadata
import importlib.util
import os
from collections.abc import Iterator
from typing import Any

from packaging.specifiers import InvalidSpecifier, SpecifierSet

ENTRY_POINT_GROUP = "titan_plugins"

# Environment switches (see docs/hooks.md and the README).
ENV_DISABLE_AUTOLOAD = "TITAN_PLUGINS_DISABLE_AUTOLOAD"
ENV_ALLOW = "TITAN_PLUGINS"
ENV_BLOCK = "TITAN_PLUGINS_BLOCK"
ENV_EXTRA = "TITAN_PLUGINS_EXTRA"
ENV_TRACE = "TITAN_TRACE_PLUGINS"


def _api_version() -> str:
    from titan_plugins import API_VERSION  # one source of truth: the package

    return API_VERSION


def _env_list(name: str) -> set[str] | None:
    raw = os.environ.get(name)
    if raw is None:
        return None
    return {item.strip() for item in raw.split(",") if item.strip()}


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() not in ("", "0", "false", "no", "off")


def api_version_matches(requirement: str) -> bool:
    """Check a plugin's ``TITAN_PLUGINS_API`` requirement (``">=1.0,<2"``)."""
    try:
        spec = SpecifierSet(requirement)
    except InvalidSpecifier:
        raise ValueError(f"cannot parse API requirement {requirement!r}") from None
    return spec.contains(_api_version())


def api_mismatch(requirement: str) -> str | None:
    """The one-line reason a plugin declaring ``requirement`` is refused (``None``: accepted)."""
    try:
        if api_version_matches(requirement):
            return None
    except ValueError:
        return (f"declares TITAN_PLUGINS_API = {requirement!r}, which is not a version range "
                f"(write e.g. \">=1.0,<2\"); this core provides API {_api_version()}")
    return f"needs titan-plugins API {requirement}, this core provides {_api_version()}"


def declared_api_range(module_name: str) -> str | None:
    """``TITAN_PLUGINS_API`` as the plugin module's source assigns it, read without running
    the module: a plugin written for another API may not even import against this core
    (a name it imports was removed), and it must be refused with the version line, not with
    that ImportError. ``None`` when the source cannot be found or assigns no string."""
    try:
        spec = importlib.util.find_spec(module_name)
        origin = spec.origin if spec is not None else None
        if not origin or not origin.endswith(".py"):
            return None
        with open(origin, encoding="utf-8") as handle:
            tree = ast.parse(handle.read(), filename=origin)
    except Exception:  # not ours to report here: loading the module reports it
        return None
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "TITAN_PLUGINS_API" for t in node.targets
        ) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            return node.value.value
    return None


def _dist_name_version(dist: Any) -> tuple[str, str]:
    if dist is None:
        return "<unknown>", "-"
    name = dist.metadata["Name"] if dist.metadata is not None else None
    return (name or "<unknown>"), (dist.version or "-")


def iter_entry_points(group: str = ENTRY_POINT_GROUP) -> Iterator[tuple[Any, Any]]:
    """``(entry_point, distribution)`` for every entry point of ``group`` (model plugins by
    default; objectives use their own group), walking the installed distributions so that
    each one is attributed to its dist."""
    seen: set[tuple[str, str]] = set()
    for dist in metadata.distributions():
        try:
            eps = [ep for ep in dist.entry_points if ep.group == group]
        except Exception:  # a distribution with broken metadata: not ours to report
            continue
        for ep in eps:
            key = (ep.name, ep.value)
            if key in seen:
                continue
            seen.add(key)
            yield ep, dist

