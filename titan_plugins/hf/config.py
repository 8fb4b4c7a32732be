"""Read a Hugging Face model folder's config.json and map it through the plugin.

Runs in the launcher (``resolve_model``), so every error here is one line before
any rank starts.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from titan_plugins.errors import ConfigError
from titan_plugins.spec import ModelSpec

__all__ = ["hf_model_values", "read_hf_config", "tokenizer_path"]


def read_hf_config(path: str | Path, key: str = "model.hf") -> dict[str, Any]:
    """The parsed ``config.json`` of a local model folder; ConfigError otherwise."""
    folder = Path(path)
    if not folder.is_dir():
        raise ConfigError(f"{key}={path}: no such folder")
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise ConfigError(f"{key}={path}: the folder has no config.json")
    try:
        data = json.loads(config_file.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{key}={path}: config.json does not parse ({exc})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{key}={path}: config.json is not a JSON object")
    if not any(folder.glob("*.safetensors")):
        raise ConfigError(f"{key}={path}: the folder has no *.safetensors weights")
    return data


def hf_model_values(spec: ModelSpec, path: str | Path) -> dict[str, Any]:
    """Values for the plugin's config schema from the folder's config.json."""
    mapper = spec.load("config_from_hf")
    if mapper is None:
        raise ConfigError(
            f"model.hf={path}: model {spec.name!r} cannot load Hugging Face folders "
            "(its plugin has no config_from_hf)"
        )
    if spec.load("state_dict_adapter") is None or not hasattr(spec.load("state_dict_adapter"), "from_hf"):
        raise ConfigError(f"model.hf={path}: model {spec.name!r} has no state-dict adapter with from_hf")
    hf_config = read_hf_config(path)
    try:
        values = mapper(hf_config)
    except ConfigError as exc:
        raise ConfigError(f"model.hf={path}: {exc}") from None
    return dict(values)


def tokenizer_path(folder: str | Path) -> Path | None:
    """The folder's tokenizer.json, if it has one."""
    candidate = Path(folder) / "tokenizer.json"
    return candidate if candidate.is_file() else None
