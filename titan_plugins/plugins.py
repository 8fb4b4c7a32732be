"""The plugin manager: entry-point discovery, allow/block lists, and the registry
of what plugins hand over (models, datasets, Hydra search-path entries).

Nothing here is module-global: ``get_plugin_manager()`` builds a fresh manager,
so tests can make their own and register plugin objects without installing them.

Every failure a plugin can cause is recorded as one line naming the plugin, its
module and ``dist==version`` (``pm.errors``) and leaves the other plugins usable;
``raise_on_errors()`` turns the first into a ``PluginLoadError`` (strict mode,
used for training), while ``titan-plugins list`` shows them all (lenient).
"""

from __future__ import annotations

import difflib
import importlib
import importlib.metadata as metadata
import inspect
import os
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pluggy

from titan_plugins import hookspecs
from titan_plugins.errors import DuplicateModelError, PluginLoadError, UnknownModelError
from titan_plugins.spec import DatasetSpec, ModelSpec

ENTRY_POINT_GROUP = "titan_plugins"
CORE_DIST = "titan-plugins"
# Always-on plugins of the core itself (like pytest's builtin plugins).
BUILTIN_PLUGINS = ("titan_plugins.builtin", "titan_plugins.train.data.builtin")
HOOK_NAMES = tuple(sorted(n for n in dir(hookspecs) if n.startswith("titan_")))

# Environment switches (see docs/hooks.md and the README).
ENV_DISABLE_AUTOLOAD = "TITAN_PLUGINS_DISABLE_AUTOLOAD"
ENV_ALLOW = "TITAN_PLUGINS"
ENV_BLOCK = "TITAN_PLUGINS_BLOCK"
ENV_EXTRA = "TITAN_PLUGINS_EXTRA"
ENV_TRACE = "TITAN_TRACE_PLUGINS"


def _api_version() -> tuple[int, ...]:
    from titan_plugins import API_VERSION  # one source of truth: the package

    return _version_tuple(API_VERSION)


def _env_list(name: str) -> set[str] | None:
    raw = os.environ.get(name)
    if raw is None:
        return None
    return {item.strip() for item in raw.split(",") if item.strip()}


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() not in ("", "0", "false", "no", "off")


def one_line(exc: BaseException) -> str:
    """``TypeName: message`` on one line (multi-line messages are joined)."""
    if isinstance(exc, pluggy.PluginValidationError):
        return _explain_validation_error(exc)
    parts = [line.strip() for line in str(exc).splitlines() if line.strip()]
    detail = "; ".join(parts)
    return f"{type(exc).__name__}: {detail}" if detail else type(exc).__name__


def _explain_validation_error(exc: pluggy.PluginValidationError) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    hook = next((line.split("for hook", 1)[1].strip().strip("'") for line in lines
                 if "for hook" in line), None)
    spec = getattr(hookspecs, hook, None) if hook else None
    rest = "; ".join(line for line in lines[1:] if not line.startswith("hookimpl definition"))
    if spec is not None:
        rest = f"{rest} (the spec is {hook}{inspect.signature(spec)})"
    return f"PluginValidationError: hook {hook!r}: {rest}" if hook else "PluginValidationError: " + "; ".join(lines)


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
    load_error: str | None = field(default=None, repr=False)  # before collection

    @property
    def origin(self) -> str:
        return f"plugin {self.name!r} ({self.module}) from {self.dist}=={self.version}"

    @property
    def builtin(self) -> bool:
        return self.name in BUILTIN_PLUGINS


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
    current = _api_version()
    for clause in requirement.split(","):
        clause = clause.strip()
        for op in (">=", "<=", "==", ">", "<"):
            if clause.startswith(op):
                if not ops[op](current, _version_tuple(clause[len(op) :])):
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
        self._load_errors: list[str] = []  # errors of loading; collection adds its own
        self._collected: tuple[dict, dict, list] | None = None
        self._owners: dict[str, PluginInfo] = {}
        self._tracing = _env_flag(ENV_TRACE)
        if self._tracing:
            # Late-bound so that a replaced sys.stderr (pytest's capsys) is honoured.
            self.trace.root.setwriter(lambda text: sys.stderr.write(text))
            self.enable_tracing()

    # ------------------------------------------------------------ registration
    def add_plugin(
        self, plugin: Any, name: str | None = None, *, dist: str = "<local>", version: str = "-"
    ) -> PluginInfo:
        """Register a module or object as a plugin; errors are recorded, not raised."""
        module = getattr(plugin, "__name__", type(plugin).__name__)
        name = name or module
        info = PluginInfo(name=name, module=module, dist=dist, version=version)
        if name in self.infos and self.infos[name].plugin is not None:
            other = self.infos[name]
            self._record(info, PluginLoadError(
                f"the plugin name {name!r} is already taken by {other.dist}=={other.version}"))
            return info
        self.infos[name] = info
        self._collected = None
        try:
            requirement = getattr(plugin, "TITAN_PLUGINS_API", None)
            if requirement and not api_version_matches(requirement):
                raise PluginLoadError(
                    f"needs titan-plugins API {requirement}, this core provides "
                    f"{'.'.join(map(str, _api_version()))}"
                )
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
                close = difflib.get_close_matches(caller.name, HOOK_NAMES, n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                raise PluginLoadError(f"implements unknown hook {caller.name!r}{hint}")

    def _record(self, info: PluginInfo, exc: BaseException) -> None:
        message = one_line(exc)
        info.error = message if info.error is None else f"{info.error}; {message}"
        info.load_error = info.error
        line = f"{info.origin} failed to load: {message}"
        self.errors.append(line)
        self._load_errors.append(line)

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
            info = PluginInfo(name=ep.name, module=ep.value, dist=dist_name, version=version)
            if ep.name in self.infos:
                other = self.infos[ep.name]
                if (other.dist, other.module) == (dist_name, ep.value):
                    continue  # the same distribution seen twice on sys.path
                self._record(info, PluginLoadError(
                    f"the plugin name {ep.name!r} is already taken by {other.dist}=={other.version}"
                    f" ({other.module}); rename one entry point or block one with {ENV_BLOCK}"))
                continue
            try:
                plugin = ep.load()
            except Exception as exc:
                self.infos[ep.name] = info
                self._fail(info, exc)
                continue
            added = self.add_plugin(plugin, name=ep.name, dist=dist_name, version=version)
            added.module = ep.value
        for name in sorted((allow or set()) - seen - set(self.infos)):
            missing = PluginInfo(name=name, module="?", dist="?", version="-")
            self._record(missing, PluginLoadError(
                f"{ENV_ALLOW} names {name!r} but no installed distribution provides it"))
        try:
            self.check_pending()
        except pluggy.PluginValidationError as exc:
            self.errors.append(f"hook validation failed: {one_line(exc)}")

    # -------------------------------------------------------------- collection
    def _collect(self) -> tuple[dict[str, ModelSpec], dict[str, DatasetSpec], list]:
        if self._collected is not None:
            return self._collected
        self.errors[:] = self._load_errors  # collection errors are recomputed each time
        for info in self.infos.values():
            info.error = info.load_error
        models: dict[str, ModelSpec] = {}
        owners: dict[str, PluginInfo] = {}
        datasets: dict[str, DatasetSpec] = {}
        dataset_owners: dict[str, PluginInfo] = {}
        searchpath: list[tuple[str, str]] = []
        duplicates: set[str] = set()
        for info in [i for i in self.infos.values() if i.plugin is not None]:
            try:
                info.model_specs = self._call_register(info, "titan_register_models", ModelSpec)
                info.dataset_specs = self._call_register(info, "titan_register_datasets", DatasetSpec)
                info.searchpath = self._call_searchpath(info)
            except Exception as exc:
                info.model_specs, info.dataset_specs, info.searchpath = [], [], []
                info.models, info.datasets = [], []
                self._record_collect(info, exc)
                continue
            info.models = [spec.name for spec in info.model_specs]
            info.datasets = [spec.name for spec in info.dataset_specs]
            for spec in info.model_specs:
                if spec.name in models or spec.name in duplicates:
                    other = owners[spec.name]
                    duplicates.add(spec.name)
                    self._record_collect(info, DuplicateModelError(
                        f"model {spec.name!r} is registered by both {other.dist}=={other.version} "
                        f"(plugin {other.name!r}) and {info.dist}=={info.version} (plugin {info.name!r})"
                    ), prefix=False)
                    continue
                models[spec.name] = spec
                owners[spec.name] = info
            for spec in info.dataset_specs:
                if spec.name in datasets:
                    other = dataset_owners[spec.name]
                    self._record_collect(info, PluginLoadError(
                        f"dataset {spec.name!r} is registered by both {other.dist}=={other.version} "
                        f"(plugin {other.name!r}) and {info.dist}=={info.version} (plugin {info.name!r})"
                    ), prefix=False)
                    continue
                datasets[spec.name] = spec
                dataset_owners[spec.name] = info
            searchpath.extend((f"{info.dist} ({info.name})", path) for path in info.searchpath)
        for name in duplicates:  # ambiguous: neither wins
            models.pop(name, None)
        self._owners = owners
        self._collected = (models, datasets, searchpath)
        return self._collected

    def _record_collect(self, info: PluginInfo, exc: BaseException, *, prefix: bool = True) -> None:
        message = one_line(exc) if prefix else str(exc)
        info.error = message if info.error is None else f"{info.error}; {message}"
        self.errors.append(f"{info.origin} failed to load: {message}" if prefix else message)

    def _impl_of(self, plugin: Any, hook_name: str) -> Any:
        for impl in getattr(self.hook, hook_name).get_hookimpls():
            if impl.plugin is plugin:
                return impl
        return None

    def _trace(self, text: str) -> None:
        if self._tracing:
            sys.stderr.write(text)

    def _call_register(self, info: PluginInfo, hook_name: str, kind: type) -> list:
        """Call one plugin's register hook directly, so every spec is attributed
        to the plugin (and distribution) that registered it."""
        specs: list = []
        impl = self._impl_of(info.plugin, hook_name)
        if impl is None:
            return specs

        def register(spec: Any) -> None:
            if not isinstance(spec, kind):
                raise TypeError(
                    f"{hook_name}: register() expects a {kind.__name__}, got {type(spec).__name__}"
                )
            specs.append(spec)

        self._trace(f"  {hook_name} [{info.name} from {info.dist}]\n")
        impl.function(**{arg: register for arg in impl.argnames})
        self._trace(f"  finish {hook_name} --> {[s.name for s in specs]}\n")
        return specs

    def _call_searchpath(self, info: PluginInfo) -> list[str]:
        impl = self._impl_of(info.plugin, "titan_config_searchpath")
        if impl is None:
            return []
        self._trace(f"  titan_config_searchpath [{info.name} from {info.dist}]\n")
        result = impl.function()
        if result is None:
            return []
        entries = [result] if isinstance(result, str) else list(result)
        for entry in entries:
            if not isinstance(entry, str) or "://" not in entry:
                raise TypeError(
                    f"titan_config_searchpath returned {entry!r}; expected 'pkg://package.conf' "
                    "or 'file:///path'"
                )
        return entries

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
        duplicate = next((e for e in self.errors if f"model {name!r} is registered by both" in e), None)
        if duplicate:
            raise DuplicateModelError(duplicate)
        close = difflib.get_close_matches(str(name), list(models), n=1, cutoff=0.5)
        if not close:
            close = [m for m in sorted(models) if str(name) and (m.startswith(str(name)) or str(name) in m)][:1]
        hint = f"; did you mean {close[0]!r}?" if close else ""
        known = ", ".join(sorted(models)) or "none installed"
        raise UnknownModelError(
            f"model={name} is not provided by any installed plugin{hint} (installed: {known})"
        )

    def raise_on_errors(self) -> None:
        """Strict mode (training): any load error stops the run."""
        self._collect()
        if self.errors:
            more = f" (and {len(self.errors) - 1} more)" if len(self.errors) > 1 else ""
            raise PluginLoadError(self.errors[0] + more)


def _dist_name_version(dist: Any) -> tuple[str, str]:
    if dist is None:
        return "<unknown>", "-"
    name = dist.metadata["Name"] if dist.metadata is not None else None
    return (name or "<unknown>"), (dist.version or "-")


def iter_entry_points() -> Iterator[tuple[Any, Any]]:
    """``(entry_point, distribution)`` for every ``titan_plugins`` entry point,
    walking the installed distributions (so each one is attributed to its dist)."""
    seen: set[tuple[str, str]] = set()
    for dist in metadata.distributions():
        try:
            eps = [ep for ep in dist.entry_points if ep.group == ENTRY_POINT_GROUP]
        except Exception:  # a distribution with broken metadata
            continue
        for ep in eps:
            key = (ep.name, ep.value)
            if key in seen:
                continue
            seen.add(key)
            yield ep, dist


_iter_entry_points = iter_entry_points  # the name the first version used


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
