"""titan-plugins: a plugin registry and trainer for TorchTitan-style model specs.

This module must stay light: listing plugins imports it and must not import torch.
"""

from titan_plugins import _moved
from titan_plugins.errors import ConfigError, PluginLoadError, TitanError
from titan_plugins.hookspecs import hookimpl
from titan_plugins.protocols import (
    DecodingModel,
    HFStateDictAdapter,
    ModelProtocol,
    StateDictAdapter,
)
from titan_plugins.spec import Capabilities, DatasetSpec, ModelSpec, PipelineInfo, resolve

__version__ = "0.1.0"
# The plugin API version: a plugin declares the range it supports (docs/writing-a-plugin.md,
# "Versioning"). 1.1: objectives (the `titan_plugins.objectives` entry-point group) and the
# shared decoder components joined the contract; nothing was removed.
API_VERSION = "1.1"
_moved.install()  # the old import paths of modules that moved rooms (until API 1.3)

__all__ = [
    "API_VERSION",
    "Capabilities",
    "ConfigError",
    "DatasetSpec",
    "DecodingModel",
    "HFStateDictAdapter",
    "ModelProtocol",
    "ModelSpec",
    "PipelineInfo",
    "PluginLoadError",
    "StateDictAdapter",
    "TitanError",
    "hookimpl",
    "resolve",
]
