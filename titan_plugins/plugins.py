"""The plugin manager: entry-point discovery, allow/block lists, and the registry
of what plugins hand over (models, datasets, Hydra search-path entries).

Nothing here is module-global: ``get_plugin_manager()`` builds a fresh manager,
so tests can make their own and register plugin objects without installing them.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.metadata as metadata
import os
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import pluggy

from titan_plugins import hookspecs
from titan_plugins.errors import DuplicateModelError, PluginLoadError, UnknownModelError
from titan_plugins.spec import DatasetSpec, ModelSpec

ENTRY_POINT_GROUP = "titan_plugins"
CORE_DIST = "titan-plugins"
# Always-on plugins of the core itself (like pytest's builtin plugins).
BUILTIN_PLUGINS = ("titan_plugins.builtin", "titan_plugins.train.data.builtin")
API_VERSION = (1, 0)


def _env_list(name: str) -> set[str] | None:
    raw = os.environ.get(name)
    if raw is None:
        return None
    return {item.strip() for item in raw.split(",") if item.strip()}


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() not in ("", "0", "false", "no")


@dataclass
class PluginInfo:
    """One loaded (or failed) plugin, as ``titan-plugins list`` shows it."""

    name: str
    module: str
    dist: str
    version: str
    plugin: Any = None
    error: str | None = None
    models: list[str] = field(default_factory=list)
    datasets: list[str] = field(default_factory=list)
    searchpath: list[str] = field(default_factory=list)
    model_specs: list[ModelSpec] = field(default_factory=list, repr=False)
    dataset_specs: list[DatasetSpec] = field(default_factory=list, repr=False)

    @property
    def origin(self) -> str:
        return f"plugin {self.name!r} ({self.module}) from {self.dist}=={self.version}"


def _version_tuple(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.strip().split(".") if part.isdigit())


def api_version_matches(requirement: str) -> bool:
    """Check a plugin's ``TITAN_PLUGINS_API`` requirement (``">=1.0,<2"``)."""
    ops = {
        ">=": lambda a, b: a >= b,
        "<=": lambda a, b: a <= b,
        "==": lambda a, b: a[: len(b)] == b,
        ">": lambda a, b: a > b,
        "<": lambda a, b: a < b,
    }
    for clause in requirement.split(","):
        clause = clause.strip()
        for op in (">=", "<=", "==", ">", "<"):
            if clause.startswith(op):
                if not ops[op](API_VERSION, _version_tuple(clause[len(op) :])):
                    return False
                break
        else:
            raise ValueError(f"cannot parse API requirement {clause!r}")
    return True


class TitanPluginManager(pluggy.PluginManager):
    """A pluggy manager that remembers where each plugin came from and collects
    models/datasets/search paths once, reporting errors against the plugin."""

    def __init__(self) -> None:
        super().__init__(hookspecs.PROJECT_NAME)
        self.add_hookspecs(hookspecs)
        self.infos: dict[str, PluginInfo] = {}
        self.errors: list[str] = []
        self._collected: tuple[dict, dict, list] | None = None
        if _env_flag("TITAN_TRACE_PLUGINS"):
            self.trace.root.setwriter(sys.stderr.write)
            self.enable_tracing()

    # ------------------------------------------------------------ registration
    def add_plugin(
        self, plugin: Any, name: str | None = None, *, dist: str = "<local>", version: str = "-"
    ) -> PluginInfo:
        """Register a module or object as a plugin; errors are recorded, not raised."""
        module = getattr(plugin, "__name__", type(plugin).__name__)
        name = name or module
        info = PluginInfo(name=name, module=module, dist=dist, version=version)
        self.infos[name] = info
        self._collected = None
        try:
            requirement = getattr(plugin, "TITAN_PLUGINS_API", None)
            if requirement and not api_version_matches(requirement):
                raise PluginLoadError(
                    f"needs titan-plugins API {requirement}, this core provides "
                    f"{'.'.join(map(str, API_VERSION))}"
                )
            self.register(plugin, name=name)
            self._check_unknown_hooks(plugin)
        except Exception as exc:  # a broken plugin must not take the others down
            self._fail(info, exc)
            return info
        info.plugin = plugin
        return info

    def _check_unknown_hooks(self, plugin: Any) -> None:
        known = [n for n in dir(hookspecs) if n.startswith("titan_")]
        for caller in self.get_hookcallers(plugin) or []:
            if caller.spec is None:
                self.unregister(plugin)
                close = difflib.get_close_matches(caller.name, known, n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise PluginLoadError(f"implements unknown hook {caller.name!r}{hint}")

    def _fail(self, info: PluginInfo, exc: BaseException) -> None:
        detail = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        info.error = f"{type(exc).__name__}: {detail}" if detail else type(exc).__name__
        self.errors.append(f"{info.origin} failed to load: {info.error}")
        if info.plugin is not None and self.is_registered(info.plugin):
            self.unregister(info.plugin)
        info.plugin = None

    def load_builtins(self) -> None:
        for module_name in BUILTIN_PLUGINS:
            try:
                module = importlib.import_module(module_name)
            except ImportError:
                continue  # a part of the core not present in this build
            self.add_plugin(module, name=module_name, dist=CORE_DIST, version=_core_version())

    def load_modules(self, module_names: Iterable[str]) -> None:
        """Register plugins by module name, without an installed distribution
        (``TITAN_PLUGINS_EXTRA=pkg.mod,...``, like pytest's ``-p``). The env
        variable reaches spawned ranks, so tests can train a model they define."""
        for module_name in module_names:
            info = PluginInfo(name=module_name, module=module_name, dist="<extra>", version="-")
            try:
                module = importlib.import_module(module_name)
            except Exception as exc:
                self.infos[module_name] = info
                self._fail(info, exc)
                continue
            self.add_plugin(module, name=module_name, dist="<extra>")

    def load_entrypoints(self, entry_points: Iterable[tuple[Any, Any]] | None = None) -> None:
        """Load every ``titan_plugins`` entry point, honouring the env switches.

        ``TITAN_PLUGINS_DISABLE_AUTOLOAD=1`` loads none except those named in
        ``TITAN_PLUGINS``; ``TITAN_PLUGINS=a,b`` loads only those;
        ``TITAN_PLUGINS_BLOCK=a,b`` never loads those.
        """
        allow = _env_list("TITAN_PLUGINS")
        block = _env_list("TITAN_PLUGINS_BLOCK") or set()
        if _env_flag("TITAN_PLUGINS_DISABLE_AUTOLOAD") and allow is None:
            return
        for ep, dist in entry_points if entry_points is not None else _iter_entry_points():
            if ep.name in block or (allow is not None and ep.name not in allow):
                continue
            dist_name = dist.metadata["Name"] if dist is not None else "<unknown>"
            version = dist.version if dist is not None else "-"
            if ep.name in self.infos:
                continue  # the same distribution seen twice on sys.path
            info = PluginInfo(name=ep.name, module=ep.value, dist=dist_name, version=version)
            try:
                plugin = ep.load()
            except Exception as exc:
                self.infos[ep.name] = info
                self._fail(info, exc)
                continue
            if not isinstance(plugin, ModuleType):
                info.module = ep.value
            self.add_plugin(plugin, name=ep.name, dist=dist_name, version=version)
            self.infos[ep.name].module = ep.value
        try:
            self.check_pending()
        except pluggy.PluginValidationError as exc:
            self.errors.append(f"hook validation failed: {exc}")

    # -------------------------------------------------------------- collection
    def _collect(self) -> tuple[dict[str, ModelSpec], dict[str, DatasetSpec], list]:
        if self._collected is not None:
            return self._collected
        models: dict[str, ModelSpec] = {}
        owners: dict[str, PluginInfo] = {}
        datasets: dict[str, DatasetSpec] = {}
        searchpath: list[tuple[str, str]] = []
        duplicates: set[str] = set()
        for info in [i for i in self.infos.values() if i.plugin is not None]:
            try:
                info.model_specs = self._call_register(info, "titan_register_models", ModelSpec)
                info.dataset_specs = self._call_register(info, "titan_register_datasets", DatasetSpec)
                info.searchpath = self._call_searchpath(info.plugin)
            except Exception as exc:
                self._fail(info, exc)
                info.model_specs, info.dataset_specs = [], []
                continue
            info.models = [spec.name for spec in info.model_specs]
            info.datasets = [spec.name for spec in info.dataset_specs]
            for spec in info.model_specs:
                if spec.name in models:
                    other = owners[spec.name]
                    duplicates.add(spec.name)
                    self.errors.append(
                        str(DuplicateModelError(
                            f"model {spec.name!r} is registered by both {other.dist}=={other.version} "
                            f"(plugin {other.name!r}) and {info.dist}=={info.version} (plugin {info.name!r})"
                        ))
                    )
                    continue
                models[spec.name] = spec
                owners[spec.name] = info
            for spec in info.dataset_specs:
                datasets.setdefault(spec.name, spec)
            searchpath.extend((f"{info.dist} ({info.name})", path) for path in info.searchpath)
        for name in duplicates:  # ambiguous: neither wins
            models.pop(name, None)
        self._owners = owners
        self._collected = (models, datasets, searchpath)
        return self._collected

    def _impl_of(self, plugin: Any, hook_name: str):
        for impl in getattr(self.hook, hook_name).get_hookimpls():
            if impl.plugin is plugin:
                return impl
        return None

    def _call_register(self, info: PluginInfo, hook_name: str, kind: type) -> list:
        """Call one plugin's register hook directly, so every spec is attributed
        to the plugin (and distribution) that registered it."""
        specs: list = []
        impl = self._impl_of(info.plugin, hook_name)
        if impl is None:
            return specs

        def register(spec: Any) -> None:
            if not isinstance(spec, kind):
                raise TypeError(f"{hook_name}: register() expects a {kind.__name__}, got {type(spec).__name__}")
            specs.append(spec)

        if self.trace.root._writer is not None:  # TITAN_TRACE_PLUGINS
            self.trace.root._writer(f"  calling {hook_name} of {info.name}\n")
        impl.function(**{arg: register for arg in impl.argnames})
        return specs

    def _call_searchpath(self, plugin: Any) -> list[str]:
        impl = self._impl_of(plugin, "titan_config_searchpath")
        if impl is None:
            return []
        result = impl.function()
        if result is None:
            return []
        return [result] if isinstance(result, str) else list(result)

    # -------------------------------------------------------------- queries
    def models(self) -> dict[str, ModelSpec]:
        return self._collect()[0]

    def datasets(self) -> dict[str, DatasetSpec]:
        return self._collect()[1]

    def searchpath(self) -> list[tuple[str, str]]:
        """``[(provider, "pkg://...")]`` for every plugin contributing config groups."""
        return self._collect()[2]

    def model_owner(self, name: str) -> PluginInfo:
        self._collect()
        return self._owners[name]

    def get_model(self, name: str) -> ModelSpec:
        models = self.models()
        if name in models:
            return models[name]
        close = difflib.get_close_matches(str(name), list(models), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        known = ", ".join(sorted(models)) or "none installed"
        raise UnknownModelError(f"model={name} is not provided by any installed plugin (known: {known}){hint}")

    def raise_on_errors(self) -> None:
        """Strict mode (training): any load error stops the run."""
        self._collect()
        if self.errors:
            raise PluginLoadError(self.errors[0] + (f" (and {len(self.errors) - 1} more)" if len(self.errors) > 1 else ""))


def _iter_entry_points() -> Iterable[tuple[Any, Any]]:
    seen: set[tuple[str, str]] = set()
    for dist in metadata.distributions():
        for ep in dist.entry_points:
            if ep.group != ENTRY_POINT_GROUP:
                continue
            key = (ep.name, ep.value)
            if key in seen:
                continue
            seen.add(key)
            yield ep, dist


def _core_version() -> str:
    from titan_plugins import __version__

    return __version__


def get_plugin_manager(*, autoload: bool = True, strict: bool = False, builtins: bool = True) -> TitanPluginManager:
    """Build a fresh manager: the core's built-in plugins, then entry points.

    ``strict=True`` (training) raises ``PluginLoadError`` on the first load error;
    the default is lenient (listing shows the errors).
    """
    pm = TitanPluginManager()
    if builtins:
        pm.load_builtins()
    pm.load_modules(sorted(_env_list("TITAN_PLUGINS_EXTRA") or ()))
    if autoload:
        pm.load_entrypoints()
    if strict:
        pm.raise_on_errors()
    return pm
