"""What a plugin got wrong, as data: one frozen ``PluginFailure`` record per
failure, turned into the line users read (``plugin 'NAME' (module) from
DIST==VERSION failed to load: ...``) only where it is shown."""

from __future__ import annotations

import enum
import inspect
from dataclasses import dataclass

import pluggy

from titan_plugins import hookspecs


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


class FailureKind(enum.Enum):
    """What went wrong, which decides how a record reads as a line."""

    PLUGIN = "plugin"  # the plugin itself: import, registration, a hook that raised
    MODEL_CLASH = "model-clash"  # two plugins registered one model name (``subject``)
    DATASET_CLASH = "dataset-clash"  # two plugins registered one dataset name (``subject``)
    HOOKS = "hooks"  # pluggy's check_pending after loading


@dataclass(frozen=True)
class PluginFailure:
    """One thing a plugin got wrong; a line only when shown (:meth:`line`)."""

    plugin: str
    module: str
    dist: str
    version: str
    reason: str  # ``TypeName: message`` on one line (a clash: the whole sentence)
    kind: FailureKind = FailureKind.PLUGIN
    subject: str | None = None  # the model or dataset name of a clash
    collected: bool = False  # found while collecting registrations (recomputed with them)

    @property
    def origin(self) -> str:
        return f"plugin {self.plugin!r} ({self.module}) from {self.dist}=={self.version}"

    @property
    def key(self) -> tuple[str, str, str, str]:
        return (self.plugin, self.module, self.dist, self.version)

    def line(self) -> str:
        if self.kind is FailureKind.PLUGIN:
            return f"{self.origin} failed to load: {self.reason}"
        if self.kind is FailureKind.HOOKS:
            return f"hook validation failed: {self.reason}"
        return self.reason
