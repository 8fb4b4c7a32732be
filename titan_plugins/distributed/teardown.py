"""Ending a rank's process groups without aborting a peer.

On gloo, a rank that destroys its process groups while a peer still has work in
flight closes the pairs under that peer, which can kill it with a C++ abort
("terminate called without an active exception") after an otherwise good run.
So a rank that finished cleanly waits at a barrier first. A rank that failed must
not: its peers may be gone or stuck, and the launcher ends the job anyway.
"""

from __future__ import annotations

import torch.distributed as dist

__all__ = ["destroy_process_groups"]


def destroy_process_groups(*, synchronize: bool) -> None:
    """Destroy every process group of this rank; ``synchronize`` (this rank's work
    finished without error): a barrier first, so that all ranks are done."""
    if not dist.is_initialized():
        return
    if synchronize:
        try:
            dist.barrier()
        except Exception:  # noqa: BLE001 - a peer failed: nothing left to wait for
            pass
    dist.destroy_process_group()
