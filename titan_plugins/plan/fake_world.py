"""One rank of a large world inside this process: torch's "fake" process group.

Every collective on the fake group returns at once without touching data, so
meshes, DTensor sharding and ``fully_shard`` run exactly as on a real rank while
nothing is sent and (with the model on the meta device) nothing is allocated.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch.distributed as dist

__all__ = ["fake_world"]


@contextmanager
def fake_world(rank: int, world_size: int) -> Iterator[None]:
    """Be ``rank`` of ``world_size`` for the duration of the block.

    Refuses to run inside an already initialised process group (a real run must
    never have its group replaced); destroys the fake group on exit, so the next
    rank starts from a clean default group.
    """
    # Importing the module registers the "fake" backend.
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("a process group is already initialised; the plan needs its own fake one")
    if not 0 <= rank < world_size:
        raise ValueError(f"plan rank {rank} is outside the world of {world_size} ranks")
    dist.init_process_group("fake", rank=rank, world_size=world_size, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()
