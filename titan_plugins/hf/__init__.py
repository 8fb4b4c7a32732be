"""Hugging Face model folders in and out: config.json through the plugin's
``config_from_hf`` / ``config_to_hf``, weights through its state-dict adapter.

The public API (covered by the plugin API version; imported lazily, so importing this
package imports no torch):

- :func:`load_hf_model`: a folder into a plugin's model, on one rank or a given mesh.
- :func:`export_model`: a live model to a folder.
- :func:`export_checkpoint`: a run directory or DCP checkpoint to a folder.
- :func:`resolve_hf_config`: the plugin's config for a folder, without building.

The rest is the core's own:

- :mod:`titan_plugins.hf.config`: read and check a folder before launch (its
  ``HFConfigMap``/``Field`` are for plugins' config mappings).
- :mod:`titan_plugins.hf.load`: sharded load, each rank reading only its slices.
- :mod:`titan_plugins.hf.export`: a DCP checkpoint or a live model to a folder.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from titan_plugins.hf.api import (
        export_checkpoint,
        export_model,
        load_hf_model,
        resolve_hf_config,
    )

__all__ = ["export_checkpoint", "export_model", "load_hf_model", "resolve_hf_config"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from titan_plugins.hf import api

        return getattr(api, name)
    raise AttributeError(f"module 'titan_plugins.hf' has no attribute {name!r}")
