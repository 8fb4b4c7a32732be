"""One rank's model parts exactly as a real launch builds them, minus the memory.

The runtime's own steps (``lifecycle.parallelized_parts``): the whole model on the
meta device, this pp rank's pipeline stages, the plugin's ``parallelize`` and the
``titan_after_parallelize`` hook per part.
What a real rank does next (``to_empty``, ``init_weights``) is the one thing left
out: the parameters stay meta DTensors whose local shapes are this rank's shards.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from torch import nn

from titan_plugins.distributed.parallel_dims import ParallelDims
from titan_plugins.spec import ModelSpec

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from titan_plugins.plugins import TitanPluginManager

__all__ = ["RankParts", "build_rank_parts", "coordinates"]

_COORD_DIMS = ("pp", "dp_replicate", "dp_shard_mod_ep", "dp_shard_in_ep", "cp", "tp")


@dataclass
class RankParts:
    rank: int
    coords: dict[str, int]
    stages: list[int]
    parts: list[nn.Module]
    num_stages: int


def coordinates(dims: ParallelDims) -> dict[str, int]:
    """This rank's index on every named mesh (the meshes must be built)."""
    out = {name: dims.world_mesh.get_local_rank(name) for name in _COORD_DIMS}
    for name in ("dp", "dp_shard", "ep"):
        mesh = dims._meshes.get(name)
        if mesh is not None:
            out[name] = mesh.get_local_rank()
    return out


def build_rank_parts(spec: ModelSpec, job: DictConfig, dims: ParallelDims, rank: int, pm: TitanPluginManager) -> RankParts:
    """Build this rank's parts; needs the fake world of ``rank`` to be active."""
    from titan_plugins.distributed import pipeline
    from titan_plugins.model.lifecycle import parallelized_parts

    dims.build_meshes("cpu")
    coords = coordinates(dims)
    split = parallelized_parts(spec, job, dims, pm)
    num_stages = pipeline.num_virtual_stages(job.parallelism) if dims.pp_enabled else 1
    return RankParts(rank, coords, [s for s, _ in split], [p for _, p in split], num_stages)
