"""The plugin manager: loading plugins (built-ins, ``TITAN_PLUGINS_EXTRA`` modules,
entry points) and the registry of what they hand over (models, datasets, Hydra
search-path entries). Where plugins come from, the environment switches and the API
range check are ``titan_plugins._discovery``'s; their names are re-exported here,
the import path plugin authors and tools use.

Nothing here is module-global: ``get_plugin_manager()`` builds a fresh manager,
so tests can make their own and register plugin objects without installing them.

Every failure a plugin can cause is kept as one ``PluginFailure`` record
(``plugin_failures``: the plugin, its module, ``dist==version`` and the reason) in ``pm.failures`` and
leaves the other plugins usable. Records become lines only where they are shown:
``pm.errors`` (``titan-plugins list``, lenient) and ``raise_on_errors()``, which
turns the first into a ``PluginLoadError`` (strict mode, used for training).
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import pluggy

from titan_plugins import hookspecs
from titan_plugins._discovery import (
    ENTRY_POINT_GROUP,
    ENV_ALLOW,
    ENV_BLOCK,
    ENV_DISABLE_AUTOLOAD,
    ENV_EXTRA,
    ENV_TRACE,
    _dist_name_version,
    _env_flag,
    _env_list,
    api_mismatch,
    api_version_matches,
    declared_api_range,
    iter_entry_points,
)
from titan_plugins._registrations import call_registrations
from titan_plugins.errors import DuplicateModelError, PluginLoadError, UnknownModelError
from titan_plugins.plugin_failures import FailureKind, PluginFailure, one_line
from titan_plugins.spec import DatasetSpec, ModelSpec
from titan_plugins.suggest import did_you_mean

__all__ = [
    "BUILTIN_PLUGINS", "CORE_DIST", "ENTRY_POINT_GROUP", "ENV_ALLOW", "ENV_BLOCK", "ENV_DISABLE_AUTOLOAD",
    "ENV_EXTRA", "ENV_TRACE", "HOOK_NAMES", "PluginInfo", "TitanPluginManager", "api_mismatch",
    "api_version_matches", "declared_api_range", "get_plugin_manager", "iter_entry_points",
]

CORE_DIST = "titan-plugins"
# Always-on plugins of the core itself (like pytest's builtin plugins).
BUILTIN_PLUGINS = ("titan_plugins.builtin", "titan_plugins.data.builtin")
HOOK_NAMES = tuple(sorted(n for n in dir(hookspecs) if n.startswith("titan_")))


@dataclass
class PluginInfo:
    """One loaded (or failed) plugin, as ``titan-plugins list`` shows it."""

    name: str
    module: str
    dist: str
    version: str
    plugin: Any = None
    models: list[str] = field(default_factory=list)
    datasets: list[str] = field(default_factory=list)
    searchpath: list[str] = field(default_factory=list)
    api: str | None = None  # the TITAN_PLUGINS_API range the plugin declares (None: undeclared)
    model_specs: list[ModelSpec] = field(default_factory=list, repr=False)
    dataset_specs: list[DatasetSpec] = field(default_factory=list, repr=False)
    # The manager's records (the same list, not a copy): ``error`` reads this plugin's.
    failures: list[PluginFailure] = field(default_factory=list, repr=False, compare=False)

    @property
    def origin(self) -> str:
        return f"plugin {self.name!r} ({self.module}) from {self.dist}=={self.version}"

    @property
    def key(self) -> tuple[str, str, str, str]:
        return (self.name, self.module, self.dist, self.version)

    @property
    def builtin(self) -> bool:
        return self.name in BUILTIN_PLUGINS

    @property
    def error(self) -> str | None:
        """This plugin's failures, ``; ``-joined (``None`` when it loaded cleanly)."""
        mine = [f.reason for f in self.failures if f.key == self.key]
        return "; ".join(mine) if mine else None


class TitanPluginManager(pluggy.PluginManager):
    """A pluggy manager that remembers where each plugin came from and collects
    models/datasets/search paths once, reporting errors against the plugin."""

    def __init__(self) -> None:
        super().__init__(hookspecs.PROJECT_NAME)
        self.add_hookspecs(hookspecs)
        self.infos: dict[str, PluginInfo] = {}
        self.failures: list[PluginFailure] = []  # the one place failures are kept
        self._collected: tuple[dict, dict, list] | None = None
        self._owners: dict[str, PluginInfo] = {}
        self._tracing = _env_flag(ENV_TRACE)
        if self._tracing:
            # Late-bound so that a replaced sys.stderr (pytest's capsys) is honoured.
            self.trace.root.setwriter(lambda text: sys.stderr.write(text))
            self.enable_tracing()

    @property
    def errors(self) -> list[str]:
        """Every failure as the line ``titan-plugins list`` prints."""
        return [f.line() for f in self.failures]

    def _info(self, name: str, module: str, dist: str, version: str) -> PluginInfo:
        return PluginInfo(name=name, module=module, dist=dist, version=version, failures=self.failures)

    # ------------------------------------------------------------ registration
    def add_plugin(
        self, plugin: Any, name: str | None = None, *, dist: str = "<local>", version: str = "-",
        module: str | None = None,
    ) -> PluginInfo:
        """Register a module or object as a plugin; errors are recorded, not raised.
        ``module`` is what to show for it (an entry point's value), else its ``__name__``."""
        module = module or getattr(plugin, "__name__", type(plugin).__name__)
        name = name or module
        info = self._info(name, module, dist, version)
        if name in self.infos and self.infos[name].plugin is not None:
            other = self.infos[name]
            self._record(info, PluginLoadError(
                f"the plugin name {name!r} is already taken by {other.dist}=={other.version}"))
            return info
        self.infos[name] = info
        self._collected = None
        try:
            requirement = getattr(plugin, "TITAN_PLUGINS_API", None)
            info.api = requirement
            reason = api_mismatch(requirement) if requirement else None
            if reason:
                raise PluginLoadError(reason)
            self.register(plugin, name=name)
            self._check_unknown_hooks(plugin)
        except Exception as exc:  # a broken plugin must not take the others down
            self._fail(info, exc)
            return info
        info.plugin = plugin
        return info

    def _check_unknown_hooks(self, plugin: Any) -> None:
        for caller in self.get_hookcallers(plugin) or []:
            if caller.spec is None:
                self.unregister(plugin)
                hint = did_you_mean(caller.name, HOOK_NAMES)
                raise PluginLoadError(f"implements unknown hook {caller.name!r}{hint}")

    def _record(
        self, info: PluginInfo, exc: BaseException, *, kind: FailureKind = FailureKind.PLUGIN,
        subject: str | None = None, collected: bool = False,
    ) -> None:
        # A clash's message is already the whole sentence; anything else is "Type: message".
        reason = one_line(exc) if kind in (FailureKind.PLUGIN, FailureKind.HOOKS) else str(exc)
        self.failures.append(PluginFailure(
            plugin=info.name, module=info.module, dist=info.dist, version=info.version,
            reason=reason, kind=kind, subject=subject, collected=collected,
        ))

    def _fail(self, info: PluginInfo, exc: BaseException) -> None:
        self._record(info, exc)
        if info.plugin is not None and self.is_registered(info.plugin):
            self.unregister(info.plugin)
        info.plugin = None
        self._collected = None

    def load_builtins(self) -> None:
        for module_name in BUILTIN_PLUGINS:
            try:
                module = importlib.import_module(module_name)
            except ModuleNotFoundError as exc:
                if exc.name is not None and module_name.startswith(exc.name):
                    continue  # a part of the core not present in this build
                raise
            self.add_plugin(module, name=module_name, dist=CORE_DIST, version=_core_version())

    def load_modules(self, module_names: Iterable[str]) -> None:
        """Register plugins by module name, without an installed distribution
        (``TITAN_PLUGINS_EXTRA=pkg.mod,...``, like pytest's ``-p``). The env
        variable reaches spawned ranks, so tests can train a model they define."""
        block = _env_list(ENV_BLOCK) or set()
        for module_name in module_names:
            if module_name in block:
                continue
            try:
                module = importlib.import_module(module_name)
            except Exception as exc:  # a broken plugin must not take the others down
                info = self._info(module_name, module_name, "<extra>", "-")
                self.infos[module_name] = info
                self._fail(info, exc)
                continue
            self.add_plugin(module, name=module_name, dist="<extra>")

    def load_entrypoints(self, entry_points: Iterable[tuple[Any, Any]] | None = None) -> None:
        """Load every ``titan_plugins`` entry point, honouring the env switches.

        ``TITAN_PLUGINS_DISABLE_AUTOLOAD=1`` loads none except those named in
        ``TITAN_PLUGINS``; ``TITAN_PLUGINS=a,b`` loads only those (a name that no
        installed plugin has is an error); ``TITAN_PLUGINS_BLOCK=a,b`` never loads those.
        ``entry_points`` (``[(entry_point, distribution)]``) replaces discovery in tests.
        """
        allow = _env_list(ENV_ALLOW)
        block = _env_list(ENV_BLOCK) or set()
        if _env_flag(ENV_DISABLE_AUTOLOAD) and allow is None:
            return
        seen: set[str] = set()
        for ep, dist in entry_points if entry_points is not None else iter_entry_points():
            seen.add(ep.name)
            if ep.name in block or (allow is not None and ep.name not in allow):
                continue
            dist_name, version = _dist_name_version(dist)
            if ep.name in self.infos:
                other = self.infos[ep.name]
                if (other.dist, other.module) == (dist_name, ep.value):
                    continue  # the same distribution seen twice on sys.path
                self._record(self._info(ep.name, ep.value, dist_name, version), PluginLoadError(
                    f"the plugin name {ep.name!r} is already taken by {other.dist}=={other.version}"
                    f" ({other.module}); rename one entry point or block one with {ENV_BLOCK}"))
                continue
            # The API range is checked before the module runs (see declared_api_range).
            declared = declared_api_range(str(ep.value).split(":", 1)[0].strip())
            reason = api_mismatch(declared) if declared else None
            if reason:
                info = self._info(ep.name, ep.value, dist_name, version)
                info.api = declared
                self.infos[ep.name] = info
                self._fail(info, PluginLoadError(reason))
                continue
            try:
                plugin = ep.load()
            except Exception as exc:  # a broken plugin must not take the others down
                info = self._info(ep.name, ep.value, dist_name, version)
                info.api = declared
                self.infos[ep.name] = info
                self._fail(info, exc)
                continue
            self.add_plugin(plugin, name=ep.name, dist=dist_name, version=version, module=ep.value)
        for name in sorted((allow or set()) - seen - set(self.infos)):
            self._record(self._info(name, "?", "?", "-"), PluginLoadError(
                f"{ENV_ALLOW} names {name!r} but no installed distribution provides it"))
        try:
            self.check_pending()
        except pluggy.PluginValidationError as exc:
            name = self.get_name(exc.plugin) or "?"
            culprit = self.infos.get(name) or self._info(name, "?", "?", "-")
            self._record(culprit, exc, kind=FailureKind.HOOKS)

    # -------------------------------------------------------------- collection
    def _collect(self) -> tuple[dict[str, ModelSpec], dict[str, DatasetSpec], list]:
        if self._collected is not None:
            return self._collected
        self.failures[:] = [f for f in self.failures if not f.collected]  # recomputed below
        active = [i for i in self.infos.values() if i.plugin is not None]
        failed = call_registrations(self, active, trace=self._tracing)
        models: dict[str, ModelSpec] = {}
        owners: dict[str, PluginInfo] = {}
        datasets: dict[str, DatasetSpec] = {}
        dataset_owners: dict[str, PluginInfo] = {}
        searchpath: list[tuple[str, str]] = []
        duplicates: set[str] = set()
        for info in active:  # registration order: which plugin a clash names first
            if info.name in failed:
                info.model_specs, info.dataset_specs, info.searchpath = [], [], []
                info.models, info.datasets = [], []
                self._record(info, failed[info.name], collected=True)
                continue
            info.models = [spec.name for spec in info.model_specs]
            info.datasets = [spec.name for spec in info.dataset_specs]
            for spec in info.model_specs:
                if spec.name in models or spec.name in duplicates:
                    other = owners[spec.name]
                    duplicates.add(spec.name)
                    self._record(info, DuplicateModelError(
                        f"model {spec.name!r} is registered by both {other.dist}=={other.version} "
                        f"(plugin {other.name!r}) and {info.dist}=={info.version} (plugin {info.name!r})"
                    ), kind=FailureKind.MODEL_CLASH, subject=spec.name, collected=True)
                    continue
                models[spec.name] = spec
                owners[spec.name] = info
            for spec in info.dataset_specs:
                if spec.name in datasets:
                    other = dataset_owners[spec.name]
                    self._record(info, PluginLoadError(
                        f"dataset {spec.name!r} is registered by both {other.dist}=={other.version} "
                        f"(plugin {other.name!r}) and {info.dist}=={info.version} (plugin {info.name!r})"
                    ), kind=FailureKind.DATASET_CLASH, subject=spec.name, collected=True)
                    continue
                datasets[spec.name] = spec
                dataset_owners[spec.name] = info
            searchpath.extend((f"{info.dist} ({info.name})", path) for path in info.searchpath)
        for name in duplicates:  # ambiguous: neither wins
            models.pop(name, None)
        self._owners = owners
        self._collected = (models, datasets, searchpath)
        return self._collected

    # -------------------------------------------------------------- queries
    def models(self) -> dict[str, ModelSpec]:
        """Every model name -> spec (a name two plugins claim is in neither)."""
        return self._collect()[0]

    def datasets(self) -> dict[str, DatasetSpec]:
        return self._collect()[1]

    def searchpath(self) -> list[tuple[str, str]]:
        """``[(provider, "pkg://...")]`` for every plugin contributing config groups."""
        return self._collect()[2]

    def model_owner(self, name: str) -> PluginInfo:
        """The plugin (with its distribution) that registered model ``name``."""
        self.get_model(name)
        return self._owners[name]

    def get_model(self, name: str) -> ModelSpec:
        models = self.models()
        if name in models:
            return models[name]
        clash = next((f for f in self.failures
                      if f.kind is FailureKind.MODEL_CLASH and f.subject == name), None)
        if clash is not None:
            raise DuplicateModelError(clash.line())
        known = ", ".join(sorted(models)) or "none installed"
        raise UnknownModelError(
            f"model={name} is not provided by any installed plugin{did_you_mean(str(name), models)} "
            f"(installed: {known})"
        )

    def raise_on_errors(self) -> None:
        """Strict mode (training): any load error stops the run."""
        self._collect()
        if self.failures:
            more = f" (and {len(self.failures) - 1} more)" if len(self.failures) > 1 else ""
            raise PluginLoadError(self.failures[0].line() + more)


def _core_version() -> str:
    from titan_plugins import __version__

    return __version__


def get_plugin_manager(
    *, autoload: bool = True, strict: bool = False, builtins: bool = True
) -> TitanPluginManager:
    """Build a fresh manager: the core's built-in plugins, ``TITAN_PLUGINS_EXTRA``
    modules, then entry points (unless ``autoload=False``).

    ``strict=True`` (training) raises ``PluginLoadError`` on the first load error;
    the default is lenient (listing shows the errors).
    """
    pm = TitanPluginManager()
    if builtins:
        pm.load_builtins()
    pm.load_modules(sorted(_env_list(ENV_EXTRA) or ()))
    if autoload:
        pm.load_entrypoints()
    if strict:
        pm.raise_on_errors()
    return pm
