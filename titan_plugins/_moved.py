"""Import paths from before the rooms were split (issue 45), kept for one API minor
version (until 1.3): ``titan_plugins.train.data.X`` is ``titan_plugins.data.X``, and so
on for the table below. The old name is an alias of the same module object (a patch
through either name reaches the one module), imported with a ``DeprecationWarning``.
Nothing inside the project imports through these names (tests/test_layers.py)."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from types import ModuleType

# old module (or package prefix) -> where it lives now
MOVED: dict[str, str] = {
    "titan_plugins.train.data": "titan_plugins.data",
    "titan_plugins.train.special_ids": "titan_plugins.data.special_ids",
    "titan_plugins.train.special_tokens": "titan_plugins.data.special_tokens",
    "titan_plugins.train.checkpoint": "titan_plugins.checkpoint.checkpointer",
    "titan_plugins.train.loss": "titan_plugins.loss.token_loss",
    "titan_plugins.train.fused_loss": "titan_plugins.loss.fused",
    "titan_plugins.train.lifecycle": "titan_plugins.model.lifecycle",
    "titan_plugins.train.optimizer": "titan_plugins.model.optimizer",
}
REMOVED_IN = "1.3"


def new_name(old: str) -> str | None:
    """Where the module once importable as ``old`` lives now (``None``: it did not move)."""
    for prefix, target in MOVED.items():
        if old == prefix or old.startswith(prefix + "."):
            return target + old[len(prefix):]
    return None


class _Alias(importlib.abc.Loader):
    def __init__(self, target: str) -> None:
        self.target = target

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        return importlib.import_module(self.target)

    def exec_module(self, module: ModuleType) -> None:  # already executed under its new name
        pass


class _MovedFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: object = None, target: object = None):
        new = new_name(fullname)
        if new is None:
            return None
        warnings.warn(f"{fullname} moved to {new}; the old name goes in titan-plugins API {REMOVED_IN}",
                      DeprecationWarning, stacklevel=3)
        return importlib.machinery.ModuleSpec(fullname, _Alias(new), is_package=True)


def install() -> None:
    if not any(isinstance(f, _MovedFinder) for f in sys.meta_path):
        # First: the path finder would otherwise load a second copy of a moved module
        # under its old name (the alias's parent package has the new folder as __path__).
        sys.meta_path.insert(0, _MovedFinder())
