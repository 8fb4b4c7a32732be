"""The rewards a run can name: the core's own and those of installed distributions
under the entry-point group ``titan_plugins.rewards``::

    [project.entry-points."titan_plugins.rewards"]
    my_reward = "my_pkg.rewards:my_reward"

The entry point's name is the reward's name (``objective.reward_funcs=[my_reward]``,
the metric ``rewards/my_reward/mean``); it loads to a function with TRL's signature.
Discovery mirrors the objectives' (``titan_plugins.objectives.registry``): each entry
point is loaded in its own try/except, so a broken one is one line naming it and its
distribution; two claiming one name is an error naming both; ``TITAN_PLUGINS_BLOCK``
names blocked ones too. A run is strict (a failure stops it before launch); listing
is lenient. A reward function may carry a ``check_options(options)`` attribute that
raises ValueError for bad ``objective.reward_options.<name>``: it runs when the job is
prepared, so a bad folder or option is one line before launch (``reward_model`` does).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from titan_plugins.errors import ConfigError
from titan_plugins.spec import resolve
from titan_plugins.suggest import did_you_mean

__all__ = ["BUILTIN_REWARDS", "ENTRY_POINT_GROUP", "RewardRegistry", "discover", "load_rewards"]

ENTRY_POINT_GROUP = "titan_plugins.rewards"
CORE = "titan-plugins"

_BUILTIN = "titan_plugins.rewards.builtin"
# name -> ("module:function", description); imported only when a run names them
BUILTIN_REWARDS: dict[str, tuple[str, str]] = {
    "accuracy": (f"{_BUILTIN}:accuracy", "1 when the completion's answer equals the row's 'answer' column "
                 "(numbers compared as numbers; math-verify where installed), else 0; None without an answer"),
    "format": (f"{_BUILTIN}:format", "1 when the completion matches a regex (option pattern; default "
               "<think>...</think><answer>...</answer>), else 0"),
    "length": (f"{_BUILTIN}:length", "DAPO's soft overlong punishment: 0 up to max_completion_len - "
               "soft_punish_cache tokens, then down to -1 at max_completion_len"),
    "reward_model": ("titan_plugins.rewards.reward_model:reward_model", "a Hugging Face sequence-classification "
                     "folder's score of prompt + completion, as TRL scores a reward model (option path=FOLDER)"),
}


@dataclass
class RewardRegistry:
    """name -> function (or its ``"module:function"``), where each came from, the load failures."""

    refs: dict[str, Any] = field(default_factory=dict)
    origins: dict[str, str] = field(default_factory=dict)
    descriptions: dict[str, str] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)

    def add(self, name: str, ref: Any, origin: str, description: str = "") -> None:
        if not (callable(ref) or isinstance(ref, str)):
            self.errors.append(f"reward entry point {name!r} from {origin} is a {type(ref).__name__}, "
                               "not a function")
            return
        if name in self.refs:
            self.errors.append(f"reward {name!r} is registered by both {self.origins[name]} and {origin}")
            return
        self.refs[name], self.origins[name] = ref, origin
        self.descriptions[name] = description or (getattr(ref, "__doc__", None) or "").strip().split("\n")[0]

    def get(self, name: str) -> Callable[..., list[float | None]]:
        if name not in self.refs:
            clash = next((e for e in self.errors if f"reward {name!r} " in e), None)
            raise ConfigError(clash or (
                f"objective.reward_funcs: {name!r} is not a known reward{did_you_mean(name, self.refs)} "
                f"(installed: {', '.join(sorted(self.refs))})"))
        ref = self.refs[name]
        return resolve(ref) if isinstance(ref, str) else ref

    def raise_on_errors(self) -> None:
        if self.errors:
            more = f" (and {len(self.errors) - 1} more)" if len(self.errors) > 1 else ""
            raise ConfigError(self.errors[0] + more)


def _entry_points() -> Iterator[tuple[Any, str]]:
    from titan_plugins.plugins import _dist_name_version, iter_entry_points

    for ep, dist in iter_entry_points(ENTRY_POINT_GROUP):
        name, version = _dist_name_version(dist)
        yield ep, f"{name}=={version}"


def discover(entry_points: Iterable[tuple[Any, str]] | None = None) -> RewardRegistry:
    """The built-in rewards, then every entry point (``[(entry_point, "dist==ver")]``
    replaces discovery in tests)."""
    from titan_plugins import __version__
    from titan_plugins.plugins import ENV_BLOCK, _env_list

    reg = RewardRegistry()
    for name, (ref, description) in BUILTIN_REWARDS.items():
        reg.add(name, ref, f"{CORE}=={__version__}", description)
    block = _env_list(ENV_BLOCK) or set()
    for ep, origin in entry_points if entry_points is not None else _entry_points():
        if ep.name in block:
            continue
        try:
            fn = ep.load()
        except Exception as exc:  # a broken reward must not take the others down
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            reg.errors.append(f"reward {ep.name!r} ({ep.value}) from {origin} failed to load: "
                              f"{type(exc).__name__}: {first}")
            continue
        reg.add(ep.name, fn, origin)
    return reg


def _check_options(name: str, fn: Any, options: Mapping[str, Any]) -> None:
    """A reward may carry ``check_options(options)``, raising ValueError for a bad folder or
    option: called here, when the job is prepared, so that it stops the run before launch."""
    check = getattr(fn, "check_options", None)
    if check is None:
        return
    try:
        check(options)
    except (ValueError, TypeError) as exc:
        text = str(exc).strip()
        raise ConfigError(f"objective.reward_options.{name}: {text.splitlines()[0] if text else type(exc).__name__}"
                          ) from None


def load_rewards(names: Iterable[str], options: Mapping[str, Mapping[str, Any]] | None = None,
                 registry: RewardRegistry | None = None) -> list[tuple[str, Callable[..., list[float | None]]]]:
    """``[(name, function)]`` of ``names``, each with its ``options`` bound as keyword
    arguments (``objective.reward_options.<name>``). Strict: a broken reward package,
    an unknown name or options for a reward not chosen stop here, in one line."""
    names = [str(n) for n in names]
    reg = registry or discover()
    reg.raise_on_errors()
    options = {str(k): dict(v or {}) for k, v in (options or {}).items()}
    stray = sorted(set(options) - set(names))
    if stray:
        raise ConfigError(f"objective.reward_options.{stray[0]}: {stray[0]!r} is not among "
                          f"objective.reward_funcs={names}")
    if len(set(names)) != len(names):
        raise ConfigError(f"objective.reward_funcs={names}: a reward is named twice")
    out = []
    for name in names:
        fn = reg.get(name)
        _check_options(name, fn, options.get(name, {}))
        out.append((name, functools.partial(fn, **options[name]) if options.get(name) else fn))
    return out
