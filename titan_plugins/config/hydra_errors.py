"""Hydra's and OmegaConf's error messages, rewritten as one line that names the key
and the value the user gave (a ``ConfigError``, exit 2).

The rewriting reads Hydra's English text (the regular expressions below), so each
message it depends on is pinned by a test in tests/test_hydra_errors.py: a Hydra
upgrade that rewords one fails there, loudly, instead of here, quietly.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

from omegaconf import DictConfig, OmegaConf

from titan_plugins.config.schema import JobConfig
from titan_plugins.config.store import model_schema_node
from titan_plugins.errors import ConfigError
from titan_plugins.plugins import TitanPluginManager
from titan_plugins.spec import ModelSpec
from titan_plugins.suggest import did_you_mean

_KEY_RE = re.compile(r"full_key:\s*(\S+)")  # OmegaConf's error footer
_TYPE_OF_RE = re.compile(r" of type '[^']*'")  # "... of type 'int'": noise in one line
_MISSING_OPTION_RE = re.compile(r"Could not find '([^']+)/([^'/]+)'")  # Hydra: unknown option
_MUST_SPECIFY_RE = re.compile(r"You must specify '([^']+)'")  # Hydra: a ??? default left unset


def _chain(exc: BaseException) -> list[BaseException]:
    """``exc`` and its causes, outermost first."""
    out: list[BaseException] = []
    cur: BaseException | None = exc
    while cur is not None and cur not in out:
        out.append(cur)
        cur = cur.__cause__ or cur.__context__
    return out


def _given(key: str, overrides: Sequence[str]) -> str:
    """The override the user typed for ``key`` (``model.n_layers=abc``), else the key."""
    for override in overrides:
        if override.lstrip("+~").split("=", 1)[0] == key:
            return override.lstrip("+~")
    return key


def _chosen_model(overrides: Sequence[str]) -> str | None:
    for override in overrides:
        key, sep, value = override.lstrip("+~").partition("=")
        if sep and key == "model":
            return value
    return None


def _keys_at(node: Any, parents: Sequence[str]) -> list[str]:
    """The keys of the config node at ``parents`` (empty where there is no such node)."""
    for part in parents:
        if not isinstance(node, DictConfig) or node._is_missing() or node._is_none():
            return []
        node = node._get_node(part)
    if not isinstance(node, DictConfig) or node._is_missing() or node._is_none():
        return []
    return [str(k) for k in node.keys()]


def _schema_keys(key: str, overrides: Sequence[str], pm: TitanPluginManager | None) -> list[str]:
    """The keys the schema allows beside ``key`` (for a "did you mean")."""
    parts = key.split(".")
    if parts[0] == "model" and len(parts) > 1:
        name = _chosen_model(overrides)
        if pm is None or name is None:
            return []
        try:
            spec = pm.get_model(name)
        except ConfigError:  # an unknown model: no schema to suggest from
            return []
        return _keys_at(model_schema_node(spec), parts[1:-1])
    return _keys_at(OmegaConf.structured(JobConfig), parts[:-1])


def _available_options(text: str, group: str) -> list[str]:
    """The options Hydra lists under ``Available options in 'group':``."""
    options: list[str] = []
    collecting = False
    for line in text.splitlines():
        if line.startswith(f"Available options in '{group}'"):
            collecting = True
            continue
        if collecting:
            if line.startswith("\t") or line.startswith("    "):
                options.append(line.strip())
            else:
                break
    return options


def _not_in_schema(key: str, given: str, model: str | None, keys: Sequence[str]) -> str:
    parts = key.split(".")
    leaf = parts[-1]
    parent = ".".join(parts[:-1])
    if parts[0] == "model" and len(parts) > 1:
        where = f"the schema of model {model or '?'!r}" + (f" (at {parent})" if parent != "model" else "")
    elif parent:
        where = f"the schema of {parent!r}"
    else:
        where = "the job schema"
    return f"{given}: key {leaf!r} is not in {where}{did_you_mean(leaf, keys)}"


def _typed_error(
    chain: Sequence[BaseException],
    given_for: Callable[[str], str],
    model: str | None,
    keys_for: Callable[[str], list[str]],
    prefix: str = "",
) -> str | None:
    """The innermost OmegaConf error that names a key, as one line."""
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException

    for err in reversed(chain):  # innermost first
        if not isinstance(err, OmegaConfBaseException):
            continue
        key = getattr(err, "full_key", None) or (m.group(1) if (m := _KEY_RE.search(str(err))) else None)
        if not key:
            continue
        key = prefix + key
        if isinstance(err, ConfigAttributeError | ConfigKeyError) and "not in" in str(err):
            return _not_in_schema(key, given_for(key), model, keys_for(key))
        first = _TYPE_OF_RE.sub("", str(err).strip().splitlines()[0])
        return f"{given_for(key)}: {first}"
    return None


def model_error(exc: BaseException, spec: ModelSpec, user: dict) -> ConfigError:
    """A merge error of flavor + overrides (or of a saved ``model`` node), with keys
    relative to ``model``."""
    node = OmegaConf.create(user)

    def given(key: str) -> str:
        value = OmegaConf.select(node, key.removeprefix("model."), default=None)
        return f"{key}={value}" if value is not None and not isinstance(value, DictConfig) else key

    def keys(key: str) -> list[str]:
        return _keys_at(model_schema_node(spec), key.split(".")[1:-1])

    line = _typed_error(_chain(exc), given, spec.name, keys, prefix="model.")
    return ConfigError(line or f"model {spec.name!r}: {str(exc).strip().splitlines()[0]}")


def _unknown_model(chain: Sequence[BaseException], pm: TitanPluginManager) -> ConfigError | None:
    """The registry's own error (``UnknownModelError`` with its suggestion) when
    Hydra could not find the option ``model=<name>``."""
    from hydra.errors import MissingConfigException

    for err in chain:
        if not isinstance(err, MissingConfigException):
            continue
        match = _MISSING_OPTION_RE.search(str(err))
        if match and match.group(1) == "model":
            try:
                pm.get_model(match.group(2))
            except ConfigError as unknown:
                return unknown
    return None


def config_error(
    exc: BaseException, overrides: Sequence[str] = (), pm: TitanPluginManager | None = None
) -> ConfigError:
    """The ``ConfigError`` (``UnknownModelError`` for an unknown model) to raise
    for a composition error; its message is :func:`format_config_error`'s line."""
    chain = _chain(exc)
    for err in chain:
        if isinstance(err, ConfigError):
            return err
    if pm is not None and (unknown := _unknown_model(chain, pm)) is not None:
        return unknown
    return ConfigError(_format(chain, overrides, pm))


def format_config_error(
    exc: BaseException, overrides: Sequence[str] = (), pm: TitanPluginManager | None = None
) -> str:
    """One line naming the key and the value, from a Hydra/OmegaConf error.

    Hydra wraps OmegaConf's typed errors (``__cause__``); the innermost error that
    names a ``full_key`` says what was wrong, the override says what was given.
    """
    return str(config_error(exc, overrides, pm))


def _format(chain: Sequence[BaseException], overrides: Sequence[str], pm: TitanPluginManager | None) -> str:
    from hydra.errors import MissingConfigException, OverrideParseException

    for err in chain:
        if match := _MUST_SPECIFY_RE.search(str(err)):
            group = match.group(1)
            if group == "model":
                known = ", ".join(sorted(pm.models())) if pm is not None else ""
                return f"model is not set: add model=<name> (installed: {known or 'none'})"
            return f"{group} is not set: add {group}=<option>"
    for err in chain:
        if isinstance(err, MissingConfigException):
            text = str(err)
            if match := _MISSING_OPTION_RE.search(text):
                group, option = match.group(1), match.group(2)
                options = _available_options(text, group)
                return (f"{group}={option}: no such preset{did_you_mean(option, options)} "
                        f"(available: {', '.join(options) or 'none'})")
        if isinstance(err, OverrideParseException):
            lines = [ln.strip() for ln in str(err).splitlines()
                     if ln.strip() and not ln.startswith("See https")]
            return "cannot parse the override: " + "; ".join(lines)
    line = _typed_error(
        chain,
        lambda key: _given(key, overrides),
        _chosen_model(overrides),
        lambda key: _schema_keys(key, overrides, pm),
    )
    if line:
        return line
    exc = chain[0]
    text = str(exc).strip()
    first = text.splitlines()[0] if text else type(exc).__name__
    match = _KEY_RE.search(text)
    if match:
        return f"{_given(match.group(1), overrides)}: {first}"
    return first
