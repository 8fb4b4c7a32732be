"""The collectives one rank issues per optimizer step, derived from its sharding.

``bytes`` is the size of the buffer a collective produces or consumes on this rank
(the all-gathered tensor, the tensor before reduce-scatter, the rows sent by an
all-to-all, the activation sent to the next stage); ``calls`` counts per step.
Per-step passes: ``n_mb`` pipeline microbatches (1 without PP) times
``training.grad_accum_steps``.

- FSDP, per ``fully_shard`` unit, on its mesh: an all-gather of the unit's
  parameters in ``param_dtype`` per forward (once per step when the unit is not
  resharded after forward), one more per backward when it is, and a
  reduce-scatter of its gradients in ``reduce_dtype`` once per gradient sync
  (every accumulation step; under PP once per step). HSDP adds an all-reduce of
  the sharded gradient over ``dp_replicate``.
- TP/SP, per block that has tensor-parallel weights: with sequence parallelism an
  all-gather (into attention / the MLP) and a reduce-scatter (out of it) of
  ``T x d`` activations per region and per pass, the same in backward with the
  roles swapped; without it two all-reduces per region and per pass. Regions: the
  attention, and the FFN unless it is an MoE that routes sequence shards (EP with
  ETP=1, whose boundary needs no collective). The first stage's embedding
  (reduce-scatter or all-reduce) and the last stage's output projection
  (all-gather) add one each.
- EP, per MoE block and pass: all-to-all dispatch and combine of ``T_r x k x d``
  rows in forward, the same two in backward (``T_r`` the tokens the rank routes).
- PP, per stage boundary and microbatch: the ``T x d`` activation sent forward and
  its gradient sent back (send/recv pairs on the ``pp`` mesh).
- CP, per attention block and pass: the whole row's keys and values all-gathered on
  the ``cp`` mesh (``b x s x (k + v)``; the two gathers of a block counted as one call
  of their summed size), again in a checkpointed block's recompute, and their
  gradients reduce-scattered in backward (``plan/context_parallel.py``). ``T`` above
  is then this rank's ``b x s / cp`` tokens.

Scalar all-reduces (loss, gradient norm) and the all-to-all of per-expert counts
are left out: a few bytes each.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from torch import nn
from torch.distributed.tensor import DTensor

from titan_plugins.plan.activations import _hidden_dim, _is_checkpointed, _moe_prefixes, _top_k
from titan_plugins.plan.context_parallel import kv_width
from titan_plugins.plan.sharding import FsdpUnit, dtype_name

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from titan_plugins.distributed.parallel_dims import ParallelDims

__all__ = ["Collective", "collectives_per_step", "summarize"]


@dataclass
class Collective:
    kind: str  # all_gather | reduce_scatter | all_reduce | all_to_all | send_recv
    mesh: str
    mesh_size: int
    what: str
    dtype: str
    bytes: int  # per call
    calls: int  # per step
    unit: str = ""  # the FSDP unit (module name), blank otherwise

    @property
    def bytes_per_step(self) -> int:
        return self.bytes * self.calls

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "bytes_per_step": self.bytes_per_step}


def _has_tp(block: nn.Module, tp_mesh_names: set[str]) -> bool:
    for p in block.parameters():
        if isinstance(p, DTensor) and set(p.device_mesh.mesh_dim_names or ()) & tp_mesh_names:
            return True
    return False


def collectives_per_step(
    parts: list[nn.Module],
    units_per_part: list[list[FsdpUnit]],
    stages: list[int],
    num_stages: int,
    job: DictConfig,
    dims: ParallelDims,
    layers_attr: str,
) -> list[Collective]:
    from titan_plugins.distributed.fsdp import to_torch_dtype

    par, training, precision = job.parallelism, job.training, job.precision
    pp = int(par.pp)
    n_mb = int(par.pp_microbatches or pp * int(par.pp_stages_per_rank)) if pp > 1 else 1
    accum = int(training.grad_accum_steps)
    passes = n_mb * accum
    syncs = accum if pp == 1 else 1
    b = max(int(training.local_batch_size) // n_mb, 1)
    cp = int(getattr(dims, "cp", 1))
    tokens = b * int(training.seq_len) // cp
    compute = precision.compute_dtype if precision.compute_dtype is not None else precision.param_dtype
    act_dtype = to_torch_dtype(compute)
    c = act_dtype.itemsize
    sp = bool(par.sequence_parallel) and dims.tp > 1
    out: list[Collective] = []

    for units in units_per_part:
        for u in units:
            gathered = u.gathered_numel * u.param_dtype.itemsize
            fwd = passes if u.reshard_after_forward else accum
            bwd = passes if u.reshard_after_forward else 0
            shard_mesh = u.mesh.split(",")[-1]
            out.append(Collective("all_gather", shard_mesh, u.shard_size, "fsdp params (fwd)",
                                  dtype_name(u.param_dtype), gathered, fwd, u.name))
            if bwd:
                out.append(Collective("all_gather", shard_mesh, u.shard_size, "fsdp params (bwd)",
                                      dtype_name(u.param_dtype), gathered, bwd, u.name))
            grad = u.gathered_numel * u.reduce_dtype.itemsize
            out.append(Collective("reduce_scatter", shard_mesh, u.shard_size, "fsdp grads",
                                  dtype_name(u.reduce_dtype), grad, syncs, u.name))
            if u.replicate_size > 1:
                out.append(Collective("all_reduce", "dp_replicate", u.replicate_size,
                                      "hsdp grads", dtype_name(u.reduce_dtype),
                                      grad // max(u.shard_size, 1), syncs, u.name))

    dt = dtype_name(act_dtype)
    for part, stage in zip(parts, stages):
        dim = _hidden_dim(part)
        act = tokens * dim * c
        blocks = getattr(part, layers_attr)
        if dims.tp > 1:
            regions = 0
            for block in blocks.values():
                if not _has_tp(block, {"tp"}):
                    continue
                moes = _moe_prefixes(block)
                seq_routed = any(getattr(getattr(m, "parallel", None), "routes_sequence_shards", False)
                                 for m in moes.values())
                regions += 1 if seq_routed else 2
            if getattr(part, "tok_embeddings", None) is not None:
                out.append(Collective("reduce_scatter" if sp else "all_reduce", "tp", dims.tp,
                                      f"tp embedding (stage {stage})", dt, act, passes))
            if regions:
                if sp:
                    out.append(Collective("all_gather", "tp", dims.tp, f"sp {regions} regions (stage {stage})",
                                          dt, act, 2 * regions * passes))
                    out.append(Collective("reduce_scatter", "tp", dims.tp, f"sp {regions} regions (stage {stage})",
                                          dt, act, 2 * regions * passes))
                else:
                    out.append(Collective("all_reduce", "tp", dims.tp, f"tp {regions} regions (stage {stage})",
                                          dt, act, 2 * regions * passes))
            if stage == num_stages - 1 and sp:
                out.append(Collective("all_gather", "tp", dims.tp, f"sp output (stage {stage})", dt, act, passes))
        if dims.ep > 1:
            moe_blocks, rows = 0, 0
            for block in blocks.values():
                for moe in _moe_prefixes(block).values():
                    par_ = getattr(moe, "parallel", None)
                    routed = tokens // dims.tp if getattr(par_, "routes_sequence_shards", False) else tokens
                    moe_blocks += 1
                    rows = max(rows, routed * _top_k(moe))
            if moe_blocks:
                out.append(Collective("all_to_all", "ep", dims.ep, f"ep dispatch+combine, {moe_blocks} MoE blocks "
                                      f"(stage {stage})", dt, rows * dim * c, 4 * moe_blocks * passes))
        if cp > 1:
            for key, block in blocks.items():
                row = b * int(training.seq_len) * kv_width(block, str(job.model.get("name", "?"))) * c
                again = 2 if _is_checkpointed(block) else 1
                out.append(Collective("all_gather", "cp", cp, f"cp keys+values (stage {stage})", dt, row,
                                      again * passes, f"{layers_attr}.{key}"))
                out.append(Collective("reduce_scatter", "cp", cp, f"cp keys+values grads (stage {stage})", dt,
                                      row, passes, f"{layers_attr}.{key}"))
        if pp > 1:
            sends = (stage != num_stages - 1) + (stage != 0)
            if sends:
                out.append(Collective("send_recv", "pp", pp, f"pp activations+grads (stage {stage})", dt,
                                      act, 2 * sends * passes))
    return out


def summarize(items: list[Collective]) -> list[dict[str, Any]]:
    """Rows merged by (kind, mesh, what, dtype): FSDP units fold into one row each
    with the calls and bytes summed and the largest single call kept."""
    rows: dict[tuple, dict[str, Any]] = {}
    for c in items:
        key = (c.kind, c.mesh, c.what, c.dtype)
        row = rows.setdefault(key, {"kind": c.kind, "mesh": c.mesh, "mesh_size": c.mesh_size,
                                    "what": c.what, "dtype": c.dtype, "calls": 0,
                                    "max_bytes": 0, "bytes_per_step": 0})
        row["calls"] += c.calls
        row["max_bytes"] = max(row["max_bytes"], c.bytes)
        row["bytes_per_step"] += c.bytes_per_step
    return list(rows.values())


