"""Ending a rank's process groups without aborting a peer.

On gloo, a rank that destroys its process groups while a peer still has work in
flight closes the pairs under that peer, which can kill it with a C++ abort
("terminate called without an active exception") after an otherwise good run.
A barrier on the default group alone does not prevent it: gloo runs each process
group's collectives on that group's own worker threads, so work queued on a
sub-group (a mesh dimension: TP, EP, FSDP) may still be in flight when the
default group's barrier returns. So a rank that finished cleanly first passes a
barrier on every group it belongs to, in creation order (the same order on every
rank; a gloo barrier waits for all work queued on its group), then destroys them
all, sub-groups first, and collects the objects that held them while the
interpreter is fully alive. A rank that failed must not wait: its peers may be
gone or stuck, and the launcher ends the job anyway.
"""

from __future__ import annotations

import gc

import torch.distributed as dist

__all__ = ["destroy_process_groups"]


def _groups_in_creation_order() -> list[dist.ProcessGroup]:
    from torch.distributed.distributed_c10d import _world

    names = _world.pg_names

    def created(pg):
        # "default_pg" first; then sub-groups by their creation counter ("0", "1", ...).
        name = names[pg]
        return (0, 0) if pg is dist.GroupMember.WORLD else (1, int(name) if name.isdigit() else 1 << 30)

    return sorted(names, key=created)


def destroy_process_groups(*, synchronize: bool) -> None:
    """Destroy every process group of this rank; ``synchronize`` (this rank's work
    finished without error): barriers first, so that all ranks' work is done."""
    if not dist.is_initialized():
        return
    if synchronize:
        try:
            for group in _groups_in_creation_order():
                if dist.get_rank(group) >= 0:  # a member (non-members get -1)
                    dist.barrier(group=group)
        except Exception:  # noqa: BLE001 - a peer failed: nothing left to wait for
            pass
    dist.destroy_process_group()
    gc.collect()  # the groups' last holders (meshes, DTensor specs) go now, not at exit
