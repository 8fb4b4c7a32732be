"""Each plugin's registration hooks called apart (``titan_register_models``,
``titan_register_datasets``, ``titan_config_searchpath``), in the order pluggy would
call them, so that every spec it registers and every error it raises is charged to
that plugin (and its distribution) and the other plugins stay usable.

The plugin manager (``titan_plugins.plugins``) builds its registry from what this
returns; clashes between plugins are the manager's to find.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

import pluggy

from titan_plugins.spec import DatasetSpec, ModelSpec

if TYPE_CHECKING:
    from titan_plugins.plugins import PluginInfo

REGISTER_HOOKS = ("titan_register_models", "titan_register_datasets", "titan_config_searchpath")


def call_registrations(
    pm: pluggy.PluginManager, active: list[PluginInfo], *, trace: bool = False
) -> dict[str, BaseException]:
    """Run the register hooks and the search-path hook of every plugin of ``active``,
    hook by hook in pluggy's call order (``tryfirst``/``trylast``, else the last
    registered first), filling each ``PluginInfo``'s ``model_specs``, ``dataset_specs``
    and ``searchpath``. Returns the failures, by plugin name; a plugin whose
    registration failed contributes nothing to the later hooks."""
    failed: dict[str, BaseException] = {}
    for info in active:
        info.model_specs, info.dataset_specs, info.searchpath = [], [], []
    for hook_name in REGISTER_HOOKS:
        for info in call_order(pm, hook_name, active):
            if info.name in failed:
                continue
            try:
                if hook_name == "titan_register_models":
                    info.model_specs = _call_register(pm, info, hook_name, ModelSpec, trace)
                elif hook_name == "titan_register_datasets":
                    info.dataset_specs = _call_register(pm, info, hook_name, DatasetSpec, trace)
                else:
                    info.searchpath = _call_searchpath(pm, info, trace)
            except Exception as exc:  # a broken plugin must not take the others down
                failed[info.name] = exc
    return failed


def call_order(pm: pluggy.PluginManager, hook_name: str, active: list[PluginInfo]) -> list[PluginInfo]:
    """The plugins of ``active`` implementing ``hook_name``, in pluggy's call order."""
    by_plugin = {id(info.plugin): info for info in active}
    order: dict[int, PluginInfo] = {}
    for impl in reversed(getattr(pm.hook, hook_name).get_hookimpls()):
        info = by_plugin.get(id(impl.plugin))
        if info is not None:  # one implementation per plugin (wrapper or not)
            order.setdefault(id(impl.plugin), info)
    return list(order.values())


def _hook_of(pm: pluggy.PluginManager, plugin: Any, hook_name: str) -> Any:
    """A pluggy caller of ``hook_name`` with only ``plugin``'s implementations
    (its wrappers included)."""
    caller = getattr(pm.hook, hook_name)
    others = {impl.plugin for impl in caller.get_hookimpls() if impl.plugin is not plugin}
    return pm.subset_hook_caller(hook_name, remove_plugins=others)


def _trace(trace: bool, text: str) -> None:
    if trace:
        sys.stderr.write(text)


def _call_register(pm: pluggy.PluginManager, info: PluginInfo, hook_name: str, kind: type,
                   trace: bool) -> list:
    """Call one plugin's register hook, so every spec is attributed to the
    plugin (and distribution) that registered it."""
    specs: list = []

    def register(spec: ModelSpec | DatasetSpec) -> None:
        if not isinstance(spec, kind):
            raise TypeError(
                f"{hook_name}: register() expects a {kind.__name__}, got {type(spec).__name__}"
            )
        specs.append(spec)

    _trace(trace, f"  {hook_name} [{info.name} from {info.dist}]\n")
    _hook_of(pm, info.plugin, hook_name)(register=register)
    _trace(trace, f"  finish {hook_name} --> {[s.name for s in specs]}\n")
    return specs


def _call_searchpath(pm: pluggy.PluginManager, info: PluginInfo, trace: bool) -> list[str]:
    _trace(trace, f"  titan_config_searchpath [{info.name} from {info.dist}]\n")
    results = _hook_of(pm, info.plugin, "titan_config_searchpath")()
    entries: list[Any] = []
    for result in results:  # pluggy leaves out None results
        entries.extend([result] if isinstance(result, str) else list(result))
    for entry in entries:
        if not isinstance(entry, str) or "://" not in entry:
            raise TypeError(
                f"titan_config_searchpath returned {entry!r}; expected 'pkg://package.conf' "
                "or 'file:///path'"
            )
    return entries
