"""Parallel degrees and the named device meshes every parallelism needs.

The world is laid out as ``pp x dp_replicate x dp_shard x cp x tp`` (tp innermost, so
tensor-parallel peers are neighbours, then the context-parallel peers that hold the
other chunks of the same rows). Expert parallelism borrows ranks: dp_shard is split
into ``dp_shard_mod_ep x dp_shard_in_ep``; the ``ep`` mesh spans ``dp_shard_in_ep``
(and ``tp`` too when ``etp == 1``). FSDP shards over ``dp_shard x cp``, as
TorchTitan's ``dp_shard_cp`` mesh: cp peers hold the same parameters and each
computes a part of their gradient.

Named meshes (``parallel_dims.mesh(name)``):

    pp          pipeline stages
    dp          every data-parallel rank (data loading: cp peers load the same rows)
    dp_shard    dp_shard's ranks
    cp          context parallel: the ranks sharing each row's sequence
    dp_shard_cp dp_shard x cp (only with cp > 1)
    dp_cp       dp x cp: every rank holding different tokens (the loss and its
                token count sum over it; only with cp > 1)
    fsdp        the FSDP mesh for dense parameters: 1-D dp_shard (dp_shard_cp with
                cp > 1), or 2-D (dp_replicate, that) for HSDP
    tp          tensor / sequence parallel
    ep          expert parallel
    etp         expert tensor parallel (the tp mesh, when etp == tp)
    expert_fsdp FSDP mesh for expert weights under EP (dp_replicate x dp_shard_mod_ep,
                x cp with cp > 1)
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field

import torch

from titan_plugins.config.schema import ParallelismConfig
from titan_plugins.errors import ConfigError


@dataclass
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    tp: int
    pp: int
    ep: int
    etp: int
    world_size: int
    cp: int = 1
    sequence_parallel: bool = True  # parallelism.sequence_parallel (what a model's validate may check under tp)
    _meshes: dict = field(default_factory=dict, repr=False)
    world_mesh: object = field(default=None, repr=False)

    # ---------------------------------------------------------------- building
    @classmethod
    def from_config(cls, cfg: ParallelismConfig, world_size: int | None = None) -> ParallelDims:
        """Resolve ``dp_shard=-1`` and check every degree; raises ConfigError."""
        world_size = world_size or cfg.world_size
        if world_size is not None and (not isinstance(world_size, int) or world_size < 1):
            raise ConfigError(f"parallelism.world_size={world_size} must be a positive integer")
        dp_shard = cfg.dp_shard
        cp = getattr(cfg, "cp", 1)  # a config composed before cp existed has none
        for key in ("dp_replicate", "tp", "pp", "ep", "etp"):
            value = getattr(cfg, key)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"parallelism.{key}={value} must be a positive integer")
        if not isinstance(cp, int) or cp < 1:
            raise ConfigError(f"parallelism.cp={cp} must be a positive integer")
        others = cfg.dp_replicate * cp * cfg.tp * cfg.pp
        if dp_shard == -1:
            if world_size is None:
                raise ConfigError(
                    "parallelism.dp_shard=-1 needs a world size: set parallelism.world_size "
                    "or launch under torchrun"
                )
            if world_size % others:
                raise ConfigError(
                    f"world size {world_size} is not divisible by dp_replicate*cp*tp*pp={others}"
                )
            dp_shard = world_size // others
        elif dp_shard < 1:
            raise ConfigError(f"parallelism.dp_shard={dp_shard} must be a positive integer or -1")
        product = others * dp_shard
        if world_size is not None and product != world_size:
            raise ConfigError(
                f"parallelism degrees multiply to {product} (dp_replicate={cfg.dp_replicate} x "
                f"dp_shard={dp_shard} x cp={cp} x tp={cfg.tp} x pp={cfg.pp}) but the world size is {world_size}"
            )
        dims = cls(cfg.dp_replicate, dp_shard, cfg.tp, cfg.pp, cfg.ep, cfg.etp, product, cp,
                   bool(getattr(cfg, "sequence_parallel", True)))
        dims.validate()
        return dims

    def validate(self) -> None:
        if self.etp not in (1, self.tp):
            raise ConfigError(
                f"parallelism.etp={self.etp} must be 1 or equal to parallelism.tp={self.tp}"
            )
        if self.ep > 1:
            if self.etp == 1:
                if self.ep % self.tp:
                    raise ConfigError(
                        f"parallelism.ep={self.ep} must be a multiple of parallelism.tp={self.tp} "
                        "when etp=1 (EP borrows all of tp)"
                    )
                borrowed = self.ep // self.tp
            else:
                borrowed = self.ep
            if self.dp_shard % borrowed:
                raise ConfigError(
                    f"parallelism.ep={self.ep} needs dp_shard divisible by {borrowed}, "
                    f"but parallelism.dp_shard={self.dp_shard}"
                )

    @property
    def dp_shard_in_ep(self) -> int:
        if self.ep == 1:
            return 1
        return self.ep // self.tp if self.etp == 1 else self.ep

    def build_meshes(self, device_type: str) -> None:
        """Create the world mesh and the flattened named meshes (needs an initialised
        process group of ``world_size`` ranks, real or fake)."""
        from torch.distributed.device_mesh import init_device_mesh

        in_ep = self.dp_shard_in_ep
        sizes = {"pp": self.pp, "dp_replicate": self.dp_replicate, "dp_shard_mod_ep": self.dp_shard // in_ep,
                 "dp_shard_in_ep": in_ep, "cp": self.cp, "tp": self.tp}
        names = ("pp", "dp_replicate", "dp_shard_mod_ep", "dp_shard_in_ep", "cp", "tp")
        if self.cp > 1 and self.ep > 1:
            # the experts' FSDP mesh spans cp (below) and meets ep in 2-D DTensors, whose
            # mesh dims must come in the root's order: cp before the ep ranks here
            names = ("pp", "dp_replicate", "dp_shard_mod_ep", "cp", "dp_shard_in_ep", "tp")
        mesh = init_device_mesh(device_type, tuple(sizes[n] for n in names), mesh_dim_names=names)

        def flat(name: str, *dims: str):
            return mesh[tuple(n for n in names if n in dims)]._flatten(name)

        self.world_mesh = mesh
        m = self._meshes
        m["pp"] = mesh["pp"]
        m["tp"] = mesh["tp"]
        m["cp"] = mesh["cp"]
        m["dp"] = flat("dp", "dp_replicate", "dp_shard_mod_ep", "dp_shard_in_ep")
        m["dp_shard"] = flat("dp_shard", "dp_shard_mod_ep", "dp_shard_in_ep")
        # cp peers route different tokens of the same rows to the same (replicated) experts:
        # their expert gradients must be summed too, so the experts' FSDP mesh spans cp
        m["expert_fsdp"] = flat("expert_fsdp", "dp_replicate", "dp_shard_mod_ep", *(("cp",) if self.cp > 1 else ()))
        shard = "dp_shard"
        if self.cp > 1:
            shard = "dp_shard_cp"
            m[shard] = flat(shard, "dp_shard_mod_ep", "dp_shard_in_ep", "cp")
            m["dp_cp"] = flat("dp_cp", "dp_replicate", "dp_shard_mod_ep", "dp_shard_in_ep", "cp")
        if self.ep > 1:
            m["ep"] = flat("ep", "dp_shard_in_ep", *(("tp",) if self.etp == 1 else ()))
        with warnings.catch_warnings():
            # Slicing a flattened dim from the root is what HSDP needs: a 2-D mesh.
            warnings.simplefilter("ignore", UserWarning)
            m["fsdp"] = mesh["dp_replicate", shard] if self.dp_replicate > 1 else m[shard]
        m["etp"] = m["tp"] if self.etp > 1 else None

    def mesh(self, name: str):
        if name not in self._meshes:
            raise KeyError(f"no mesh named {name!r}; call build_meshes() first or check the name")
        return self._meshes[name]

    # ------------------------------------------------------------- properties
    @property
    def dp_enabled(self) -> bool:
        return self.dp_replicate * self.dp_shard > 1

    @property
    def fsdp_enabled(self) -> bool:
        """FSDP shards parameters: over dp_shard x cp."""
        return self.dp_shard * self.cp > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def hsdp_enabled(self) -> bool:
        return self.dp_replicate > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    @property
    def etp_enabled(self) -> bool:
        return self.etp > 1

    @property
    def dp_size(self) -> int:
        return self.dp_replicate * self.dp_shard

    def dp_rank(self) -> int:
        return self.mesh("dp").get_local_rank() if self.dp_size > 1 else 0

    def describe(self) -> str:
        parts = [f"{k}={getattr(self, k)}" for k in ("dp_replicate", "dp_shard", "cp", "tp", "pp", "ep", "etp")]
        return f"world={self.world_size} " + " ".join(parts)


def default_device_and_backend(device: str = "auto", backend: str = "auto") -> tuple[str, str]:
    """cuda + nccl where a GPU is visible, else cpu + gloo; both overridable."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if backend == "auto":
        backend = "nccl" if device == "cuda" else "gloo"
    return device, backend


def threads_per_rank(local_world_size: int) -> int:
    """Intra-op threads so that local ranks do not oversubscribe the cores."""
    if "OMP_NUM_THREADS" in os.environ:
        return int(os.environ["OMP_NUM_THREADS"])
    return max(1, (os.cpu_count() or 1) // max(1, local_world_size))
