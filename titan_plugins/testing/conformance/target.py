"""``Target``: which model the kit checks and with which overrides. Imports no torch."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from dataclasses import dataclass

__all__ = ["Target"]


@dataclass(frozen=True)
class Target:
    """What the kit checks: model ``model`` with ``overrides`` (Hydra, e.g.
    ``"model.n_layers=2"``). ``plugins`` names plugin modules registered without an
    installed distribution (like ``TITAN_PLUGINS_EXTRA``); they must be importable.
    ``ep_overrides`` are added for the EP check (e.g. a flavor with experts) and
    ``pp_overrides`` for the pipeline checks (e.g. untied embeddings)."""

    model: str
    overrides: tuple[str, ...] = ()
    plugins: tuple[str, ...] = ()
    ep_overrides: tuple[str, ...] = ()
    pp_overrides: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for name in ("overrides", "plugins", "ep_overrides", "pp_overrides"):
            object.__setattr__(self, name, tuple(getattr(self, name)))

    def for_kind(self, kind: str) -> Target:
        """This target with the overrides of one parallelism (``ep``, ``pp``) added."""
        extra = {"ep": self.ep_overrides, "pp": self.pp_overrides}.get(kind, ())
        if not extra:
            return self
        return dataclasses.replace(self, overrides=self.overrides + extra, ep_overrides=(), pp_overrides=())

    def env(self) -> dict[str, str]:
        """The environment for subprocesses: this interpreter's import path and the
        extra plugin modules."""
        env = dict(os.environ)
        paths = [p for p in sys.path if p and os.path.isdir(p)]
        paths += [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
        if self.plugins:
            current = [m for m in env.get("TITAN_PLUGINS_EXTRA", "").split(",") if m]
            env["TITAN_PLUGINS_EXTRA"] = ",".join(dict.fromkeys([*current, *self.plugins]))
        env.setdefault("OMP_NUM_THREADS", "1")
        return env

    def as_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Target:
        return cls(**json.loads(text))
