"""The core's own hook implementations (a built-in plugin, always registered)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from titan_plugins.hookspecs import hookimpl

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from titan_plugins.distributed.parallel_dims import ParallelDims


@hookimpl(trylast=True)
def titan_after_parallelize(model: Any, parallel_dims: ParallelDims, job_config: DictConfig) -> Any:
    # The innermost result of the firstresult chain: the model as the plugin left it.
    return model
