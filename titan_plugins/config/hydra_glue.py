"""The Hydra glue, as one import: plugins, tests and the CLI import from here.

Each job lives in its own module: ``options`` (what the config tree offers),
``store`` (the ConfigStore and the plugins' search path), ``compose``
(composition and the resolved job) and ``hydra_errors`` (Hydra's messages as
one-line errors).
"""

from __future__ import annotations

from titan_plugins.config.compose import (
    compose,
    model_config,
    normalize_overrides,
    resolve_job,
    resolve_model,
)
from titan_plugins.config.hydra_errors import config_error, format_config_error
from titan_plugins.config.options import (
    CONFIG_MODULE,
    CORE_PROVIDER,
    PRIMARY_CONFIG,
    config_options,
    list_config_options,
)
from titan_plugins.config.store import (
    MODEL_META_KEYS,
    TitanSearchPathPlugin,
    model_schema_node,
    register_configs,
)

__all__ = [
    "CONFIG_MODULE",
    "CORE_PROVIDER",
    "MODEL_META_KEYS",
    "PRIMARY_CONFIG",
    "TitanSearchPathPlugin",
    "compose",
    "config_error",
    "config_options",
    "format_config_error",
    "list_config_options",
    "model_config",
    "model_schema_node",
    "normalize_overrides",
    "register_configs",
    "resolve_job",
    "resolve_model",
]
