"""``objective.precompute_ref=true``: the reference's per-row values (DPO: each
completion's summed log-prob) computed once from the starting weights, in a first pass
without gradient, and kept in the run directory (``reference_logps.pt``), so full
fine-tuning needs no frozen copy of the model.

Each value is keyed by its row's identity in the source: a hash of the row's tokens and
labels, i.e. the pair as the source renders it. No rank, step or position enters the
key, so a resumed run and any data-parallel layout find every pair's values; a row the
store does not hold (the data changed under it) is one line, never a silent mismatch.
The file also records what the values depend on (the starting weights' settings, the
data, ``training.seq_len``); a run that finds a file made for another start stops with
one line instead of reusing it.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from titan_plugins.errors import ConfigError

__all__ = ["STORE", "ReferenceStore", "first_pass", "on_every_rank", "row_keys"]

STORE = "reference_logps.pt"
VERSION = 1


def row_keys(inputs: torch.Tensor, labels: torch.Tensor) -> list[int]:
    """One 64-bit key per row of a ``[rows, seq]`` batch: a hash of its tokens and labels."""
    rows = torch.cat([inputs.long(), labels.long()], dim=-1).cpu().numpy()
    return [int.from_bytes(hashlib.blake2b(row.tobytes(), digest_size=8).digest(), "little", signed=True)
            for row in rows]


class ReferenceStore:
    """``key -> value`` (one row's reference value, a tensor) with the file it lives in."""

    def __init__(self, path: Path, values: dict[int, torch.Tensor], *, computed: bool) -> None:
        self.path, self.values, self.computed = path, values, computed

    def lookup(self, inputs: torch.Tensor, labels: torch.Tensor, device: torch.device) -> torch.Tensor:
        """The stored values of a batch's rows, stacked in row order."""
        try:
            rows = [self.values[k] for k in row_keys(inputs, labels)]
        except KeyError:
            raise ConfigError(
                f"objective.precompute_ref=true: {self.path} holds no reference value for a row of this batch "
                "(the data changed since the first pass?); delete it to recompute from the starting weights"
            ) from None
        return torch.stack(rows).to(device)

    @staticmethod
    def gather(local: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        """Every rank's values, on every rank (two tensors per rank, not one object per row)."""
        if not local:
            raise ConfigError("objective.precompute_ref=true: the first pass saw no rows")
        keys = torch.tensor(list(local), dtype=torch.int64)
        values = torch.stack(list(local.values())).cpu()
        if not (dist.is_initialized() and dist.get_world_size() > 1):
            return dict(zip(keys.tolist(), values, strict=True))
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, (keys, values))
        merged: dict[int, torch.Tensor] = {}
        for k, v in everyone:  # TP peers hold the same rows with the same values
            merged.update(zip(k.tolist(), v, strict=True))
        return merged

    def save(self, meta: dict[str, Any]) -> None:
        """Write the file (rank 0 only), atomically: a half-written store is never read."""
        keys = torch.tensor(list(self.values), dtype=torch.int64)
        tmp = self.path.with_name(self.path.name + ".tmp")
        torch.save({"version": VERSION, "meta": meta, "keys": keys, "values": torch.stack(list(self.values.values()))},
                   tmp)
        os.replace(tmp, self.path)

    @classmethod
    def load(cls, path: Path, meta: dict[str, Any]) -> ReferenceStore:
        saved = torch.load(path, map_location="cpu", weights_only=True)
        if saved.get("version") != VERSION or saved.get("meta") != meta:
            differ = sorted(k for k in set(meta) | set(saved.get("meta") or {})
                            if (saved.get("meta") or {}).get(k) != meta.get(k))
            raise ConfigError(
                f"objective.precompute_ref=true: {path} was computed for another start or data "
                f"({', '.join(differ) or 'version'} differ); delete it to recompute from this run's starting weights"
            )
        return cls(path, dict(zip(saved["keys"].tolist(), saved["values"], strict=True)), computed=False)


def on_every_rank(path: Path) -> bool:
    """Whether every rank sees ``path`` (so all read it, or all run the first pass together)."""
    seen = torch.tensor([int(path.is_file())])
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(seen, op=dist.ReduceOp.MIN)  # gloo: CPU tensors; nccl jobs run cpu:gloo too
    return bool(seen.item())


def first_pass(batches: Iterable[tuple[torch.Tensor, torch.Tensor]], values_of: Any) -> dict[int, torch.Tensor]:
    """``{key: value}`` of every row of ``batches``; ``values_of(inputs, labels)`` is the
    reference's value per row (one forward without gradient)."""
    out: dict[int, torch.Tensor] = {}
    for inputs, labels in batches:
        values = values_of(inputs, labels)
        if not isinstance(values, torch.Tensor) or values.shape[:1] != inputs.shape[:1]:
            raise ConfigError("objective.precompute_ref=true: the objective's reference_stats is not one value "
                              "per row, which is what a store can hold")
        out.update(zip(row_keys(inputs, labels), values.detach().cpu(), strict=True))
    return out
