"""Build the plan: validate like a launch, then every chosen rank in the fake world."""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from omegaconf import OmegaConf

from titan_plugins.errors import ConfigError
from titan_plugins.spec import ModelSpec

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from titan_plugins.distributed.parallel_dims import ParallelDims
    from titan_plugins.plugins import TitanPluginManager

__all__ = ["GIB", "Plan", "RankPlan", "default_ranks", "make_plan"]

GIB = 1024**3  # plan.device_memory_gb is read in GiB, the unit torch.cuda reports


@dataclass
class RankPlan:
    rank: int
    coords: dict[str, int]
    stages: list[dict[str, Any]]  # per local stage: index, modules, layers, numel
    memory: Any  # MemoryBreakdown
    fsdp_transient: dict[str, int]
    activations: Any  # ActivationEstimate
    collectives: list[Any]  # Collective
    seconds: float
    meshes: dict[str, Any] = field(default_factory=dict)

    @property
    def peak_bytes(self) -> int:
        m = self.memory
        return (m.total("parameters") + m.total("gradients") + m.total("optimizer")
                + m.total("buffers") + sum(self.fsdp_transient.values()) + self.activations.total_bytes)


@dataclass
class Plan:
    model: str
    flavor: str
    world_size: int
    degrees: dict[str, int]
    meshes: dict[str, int]
    precision: dict[str, Any]
    training: dict[str, Any]
    device_memory_gb: float
    ranks: list[RankPlan] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def peak(self) -> RankPlan:
        return max(self.ranks, key=lambda r: r.peak_bytes)

    @property
    def fits(self) -> bool:
        return self.peak.peak_bytes <= self.device_memory_gb * GIB


def default_ranks(dims: ParallelDims) -> list[int]:
    """Rank 0 and the first rank of the last pipeline stage (pp is the outermost dim)."""
    last = (dims.pp - 1) * (dims.world_size // dims.pp)
    return sorted({0, last})


def _stage_summary(part: Any, stage: int, layers_attr: str) -> dict[str, Any]:
    from titan_plugins.plan.sharding import local_numel

    keys = [int(k) for k in getattr(part, layers_attr).keys()]
    modules = [name for name, child in part.named_children() if child is not None and name != layers_attr]
    layers = f"{layers_attr}.{min(keys)}-{max(keys)}" if keys else f"{layers_attr}: none"
    return {
        "stage": stage,
        "modules": modules,
        "layers": layers,
        "n_layers": len(keys),
        "numel": sum(local_numel(p) for p in part.parameters()),
    }


def _plan_rank(spec: ModelSpec, job: DictConfig, pm: TitanPluginManager, rank: int) -> RankPlan:
    from titan_plugins.distributed.fsdp import to_torch_dtype
    from titan_plugins.distributed.parallel_dims import ParallelDims
    from titan_plugins.plan.activations import estimate_activations
    from titan_plugins.plan.build import build_rank_parts
    from titan_plugins.plan.collectives import collectives_per_step
    from titan_plugins.plan.fake_world import fake_world
    from titan_plugins.plan.memory import fsdp_transient_bytes, state_memory
    from titan_plugins.plan.sharding import fsdp_units

    start = time.perf_counter()
    weight_dtype = to_torch_dtype(job.precision.weight_dtype)
    info = spec.pipeline
    layers_attr = info.layers_attr if info is not None else "layers"
    last_modules = info.last_stage_modules if info is not None else ("output",)
    dims = ParallelDims.from_config(job.parallelism, world_size=job.parallelism.world_size)
    with fake_world(rank, dims.world_size):
        rp = build_rank_parts(spec, job, dims, rank, pm)
        units_per_part = [fsdp_units(part, weight_dtype) for part in rp.parts]
        units = [u for us in units_per_part for u in us]
        memory = state_memory(rp.parts, units, weight_dtype)
        transient = fsdp_transient_bytes(units)
        acts = estimate_activations(rp.parts, job, dims, rp.coords["pp"], layers_attr, last_modules)
        comms = collectives_per_step(rp.parts, units_per_part, rp.stages, rp.num_stages, job, dims, layers_attr)
        stages = [_stage_summary(p, s, layers_attr) for s, p in zip(rp.stages, rp.parts)]
        meshes = {"world": " x ".join(f"{n}={s}" for n, s in zip(dims.world_mesh.mesh_dim_names,
                                                                dims.world_mesh.shape))}
        meshes.update({name: mesh.size() for name, mesh in dims._meshes.items() if mesh is not None})
        coords = rp.coords
        del rp
    plan = RankPlan(rank, coords, stages, memory, transient, acts, comms, time.perf_counter() - start)
    plan.meshes = meshes
    return plan


def make_plan(spec: ModelSpec, job: DictConfig, pm: TitanPluginManager) -> Plan:
    """Validate exactly as a launch does, then plan each chosen rank."""
    from titan_plugins.train.api import validate_job

    start = time.perf_counter()
    job = copy.deepcopy(job)  # parallelism.world_size is filled in below
    dims = validate_job(spec, job, pm)
    job.parallelism.world_size = dims.world_size
    job.parallelism.dp_shard = dims.dp_shard
    ranks = list(job.plan.ranks) if job.plan.ranks else default_ranks(dims)
    for r in ranks:
        if not 0 <= int(r) < dims.world_size:
            raise ConfigError(f"plan.ranks: rank {r} is outside the world of {dims.world_size} ranks")
    plan = Plan(
        model=spec.name,
        flavor=str(job.model.get("flavor", spec.default_flavor)),
        world_size=dims.world_size,
        degrees={k: getattr(dims, k) for k in ("dp_replicate", "dp_shard", "cp", "tp", "pp", "ep", "etp")},
        meshes={},
        precision={k: _plain(job.precision[k]) for k in ("weight_dtype", "param_dtype", "reduce_dtype", "compute_dtype")},
        training={
            "local_batch_size": int(job.training.local_batch_size),
            "seq_len": int(job.training.seq_len),
            "grad_accum_steps": int(job.training.grad_accum_steps),
            "activation_checkpoint": _plain(job.training.activation_checkpoint),
            "pp_schedule": _plain(job.parallelism.pp_schedule),
            "pp_microbatches": job.parallelism.pp_microbatches,
        },
        device_memory_gb=float(job.plan.device_memory_gb),
    )
    for r in ranks:
        plan.ranks.append(_plan_rank(spec, job, pm, int(r)))
    plan.meshes = plan.ranks[0].meshes
    plan.seconds = time.perf_counter() - start
    return plan


def _plain(x: Any) -> Any:
    x = getattr(x, "value", x)
    return OmegaConf.to_container(x) if OmegaConf.is_config(x) else x
