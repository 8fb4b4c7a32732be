"""What a forward-only pass (validation, a DPO reference pass, the precomputed reference)
must undo so that training goes on bitwise as if it had not run."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

__all__ = ["moe_counters_kept", "resharded"]


@contextlib.contextmanager
def resharded(parts: list[torch.nn.Module]) -> Iterator[None]:
    """Reshard every FSDP unit after the forward passes. FSDP2 keeps the units that do not
    reshard after forward (the last block, the head, every unit under PP) unsharded until
    their backward, which a forward-only pass never runs: the modules would keep the
    unsharded parameters registered, not the sharded ones the optimizer holds, and the
    next checkpoint's optimizer state could not name them (``KeyError`` in
    ``get_optimizer_state_dict``)."""
    try:
        yield
    finally:
        from torch.distributed.fsdp import FSDPModule

        for part in parts:
            for module in part.modules():
                if isinstance(module, FSDPModule):
                    module.reshard()


@contextlib.contextmanager
def moe_counters_kept(parts: list[torch.nn.Module]) -> Iterator[None]:
    """Forward passes add to every MoE's ``tokens_per_expert`` (which the load-balancing
    hook reads before the next optimizer step); put them back after."""
    saved = [(buf, buf.detach().clone()) for part in parts
             for name, buf in part.named_buffers() if name.endswith("tokens_per_expert")]
    try:
        yield
    finally:
        with torch.no_grad():
            for buf, value in saved:
                buf.copy_(value)
