"""Errors a user can cause. Each one prints as one line and exits with code 2."""

from __future__ import annotations


class TitanError(Exception):
    """Base class: the CLI prints ``error: <message>`` and exits 2, no traceback."""

    exit_code = 2


class ConfigError(TitanError):
    """A configuration value is wrong. The message names the key and the value."""


class PluginLoadError(TitanError):
    """A plugin could not be loaded or registered."""


class DuplicateModelError(PluginLoadError):
    """Two plugins claim the same model name."""


class UnknownModelError(ConfigError):
    """No installed plugin provides the requested model."""
