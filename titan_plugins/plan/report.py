"""The plan as text for people and JSON for tools (``plan.json=true`` / ``--json``)."""

from __future__ import annotations

import json
from typing import Any

from titan_plugins.plan.collectives import summarize
from titan_plugins.plan.planner import GIB, Plan, RankPlan

__all__ = ["plan_dict", "render_json", "render_text", "human_bytes"]

_MEMORY_ROWS = ("parameters", "gradients", "optimizer", "buffers")


def human_bytes(n: float) -> str:
    for unit, size in (("GiB", GIB), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def _memory_rows(r: RankPlan) -> list[tuple[str, dict[str, int]]]:
    rows = [(key, getattr(r.memory, key)) for key in _MEMORY_ROWS]
    rows.append(("fsdp unsharded", r.fsdp_transient))
    rows.append(("activations", {r.activations.dtype: r.activations.total_bytes}))
    return rows


def _verdict(plan: Plan) -> str:
    peak = plan.peak
    budget = plan.device_memory_gb * GIB
    share = peak.peak_bytes / budget if budget else float("inf")
    word = "fits" if plan.fits else "DOES NOT FIT"
    return (f"summary: peak {human_bytes(peak.peak_bytes)} per rank (rank {peak.rank}) against "
            f"plan.device_memory_gb={plan.device_memory_gb:g} ({human_bytes(budget)}): {word} "
            f"({share:.0%})")


def render_text(plan: Plan) -> str:
    d = plan.degrees
    lines = [
        f"plan: {plan.model} {plan.flavor} on {plan.world_size} ranks ("
        + " ".join(f"{k}={v}" for k, v in d.items()) + ")",
        "meshes: " + ", ".join(f"{k} {v}" for k, v in plan.meshes.items()),
        "precision: " + ", ".join(f"{k.removesuffix('_dtype')} {v or '-'}" for k, v in plan.precision.items())
        + f"; batch {plan.training['local_batch_size']} x seq {plan.training['seq_len']}, "
        f"AC {plan.training['activation_checkpoint']}"
        + (f", {plan.training['pp_schedule']}" if d["pp"] > 1 else ""),
    ]
    for r in plan.ranks:
        coords = " ".join(f"{k} {v}" for k, v in r.coords.items() if k in ("pp", "dp", "tp", "ep"))
        lines += ["", f"rank {r.rank} ({coords}) planned in {r.seconds:.1f} s"]
        for s in r.stages:
            mods = ", ".join(s["modules"])
            lines.append(f"  stage {s['stage']}: {s['layers']}" + (f" + {mods}" if mods else "")
                         + f"; {s['numel']:,} parameters on this rank")
        rows = _memory_rows(r)
        dtypes = sorted({dt for _, by in rows for dt in by})
        lines.append("  memory".ljust(22) + "".join(dt.rjust(14) for dt in dtypes) + "total".rjust(14))
        for name, by in rows:
            lines.append(f"    {name}".ljust(22) + "".join(
                (human_bytes(by[dt]) if dt in by else "-").rjust(14) for dt in dtypes)
                + human_bytes(sum(by.values())).rjust(14))
        a = r.activations
        ckpt = sum(b["checkpointed"] for b in a.blocks)
        lines.append(f"    (activations: {len(a.blocks)} blocks, {ckpt} checkpointed, microbatch "
                     f"{a.microbatch_size} x {a.tokens_per_microbatch // max(a.microbatch_size, 1)} tokens, "
                     f"{a.in_flight:g} in flight, logits {human_bytes(a.logits_bytes)}"
                     + (f", cp mask {human_bytes(a.cp_mask_bytes)}" if a.cp_mask_bytes else "") + ")")
        lines.append("    peak".ljust(22) + human_bytes(r.peak_bytes).rjust(14 * (len(dtypes) + 1)))
        lines.append("  collectives per step".ljust(58) + "calls".rjust(7) + "max bytes".rjust(13)
                     + "bytes/step".rjust(13))
        for row in summarize(r.collectives):
            label = f"    {row['kind']} {row['mesh']}({row['mesh_size']}) {row['what']} [{row['dtype']}]"
            lines.append(label.ljust(58) + str(row["calls"]).rjust(7) + human_bytes(row["max_bytes"]).rjust(13)
                         + human_bytes(row["bytes_per_step"]).rjust(13))
    lines += ["", _verdict(plan)]
    return "\n".join(lines)


def _rank_dict(r: RankPlan) -> dict[str, Any]:
    m = r.memory
    return {
        "rank": r.rank,
        "coords": r.coords,
        "stages": r.stages,
        "numel": m.numel,
        "memory_bytes": {
            **{key: getattr(m, key) for key in _MEMORY_ROWS},
            "fsdp_unsharded": r.fsdp_transient,
            "activations": {
                "total": r.activations.total_bytes,
                "dtype": r.activations.dtype,
                "in_flight_microbatches": r.activations.in_flight,
                "recompute": r.activations.recompute_bytes,
                "logits": r.activations.logits_bytes,
                "cp_mask": r.activations.cp_mask_bytes,
                "blocks": r.activations.blocks,
            },
            "peak": r.peak_bytes,
        },
        "collectives": [c.as_dict() for c in r.collectives],
        "collectives_summary": summarize(r.collectives),
        "seconds": round(r.seconds, 3),
    }


def plan_dict(plan: Plan) -> dict[str, Any]:
    peak = plan.peak
    return {
        "model": plan.model,
        "flavor": plan.flavor,
        "world_size": plan.world_size,
        "degrees": plan.degrees,
        "meshes": plan.meshes,
        "precision": plan.precision,
        "training": plan.training,
        "ranks": [_rank_dict(r) for r in plan.ranks],
        "summary": {
            "peak_bytes": peak.peak_bytes,
            "peak_rank": peak.rank,
            "device_memory_gb": plan.device_memory_gb,
            "device_memory_bytes": int(plan.device_memory_gb * GIB),
            "fits": plan.fits,
            "line": _verdict(plan),
        },
        "seconds": round(plan.seconds, 3),
    }


def render_json(plan: Plan) -> str:
    return json.dumps(plan_dict(plan), indent=2)
