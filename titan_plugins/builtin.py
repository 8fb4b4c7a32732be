"""The core's own hook implementations (a built-in plugin, always registered)."""

from __future__ import annotations

from typing import Any

from titan_plugins.hookspecs import hookimpl


@hookimpl(trylast=True)
def titan_after_parallelize(model: Any, parallel_dims: Any, job_config: Any) -> Any:
    # The innermost result of the firstresult chain: the model as the plugin left it.
    return model
