"""Expert-parallel token dispatch: all-to-all of counts then tokens, and the reverse.

After the token all-to-all, rows arrive grouped by (source rank, local expert); a
local permutation regroups them by local expert, padding every expert's group to a
multiple of ``TOKEN_GROUP_ALIGN_SIZE_M`` rows (at least one multiple, like
TorchTitan's ``generate_permute_indices``) so grouped GEMMs see aligned groups.
Pad rows are zeros and are dropped again on the way back.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import all_to_all_single_autograd

TOKEN_GROUP_ALIGN_SIZE_M = 8


def aligned_expert_permutation(
    counts: torch.Tensor, align: int
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Where each received row goes in the expert-grouped, padded buffer.

    ``counts``: int64 ``(sources, local_experts)``; rows arrive ordered by source,
    then by expert. Returns ``dest`` (``(rows,)``: target row of each received row),
    the padded per-expert sizes ``(local_experts,)`` and the padded total.
    """
    sources, experts = counts.shape
    per_expert = counts.sum(dim=0)
    padded = (per_expert.clamp_min(align) + align - 1) // align * align
    expert_start = torch.cumsum(padded, 0) - padded  # exclusive prefix sums
    before_in_expert = torch.cumsum(counts, 0) - counts  # rows of earlier sources, per expert
    flat = counts.reshape(-1)
    seg_start = torch.cumsum(flat, 0) - flat
    seg = torch.repeat_interleave(torch.arange(sources * experts, device=counts.device), flat)
    within = torch.arange(seg.numel(), device=counts.device) - seg_start[seg]
    expert = seg % experts
    dest = expert_start[expert] + before_in_expert.reshape(-1)[seg] + within
    return dest, padded, int(padded.sum())


@dataclass
class DispatchState:
    input_splits: list[int]
    output_splits: list[int]
    dest: torch.Tensor


class AllToAllTokenDispatcher:
    """Dispatch over the ``ep`` process group; ``num_experts`` global experts."""

    def __init__(self, group: dist.ProcessGroup, num_experts: int):
        self.group = group
        self.ep_degree = dist.get_world_size(group)
        if num_experts % self.ep_degree:
            raise ValueError(
                f"num_experts={num_experts} is not divisible by the expert-parallel degree "
                f"{self.ep_degree}"
            )
        self.num_local_experts = num_experts // self.ep_degree

    def dispatch(
        self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, DispatchState]:
        """``x``: rows sorted by global expert; returns the local experts' padded,
        expert-grouped rows, their per-expert row counts and the state for combine."""
        ep, local = self.ep_degree, self.num_local_experts
        with torch.no_grad():
            send_counts = num_tokens_per_expert.to(torch.int64)
            recv_counts = torch.empty_like(send_counts)
            dist.all_to_all_single(recv_counts, send_counts, group=self.group)
            recv_counts = recv_counts.view(ep, local)
            input_splits = send_counts.view(ep, local).sum(dim=1).tolist()
            output_splits = recv_counts.sum(dim=1).tolist()
            dest, padded_counts, total = aligned_expert_permutation(
                recv_counts, TOKEN_GROUP_ALIGN_SIZE_M
            )
        received = all_to_all_single_autograd(x, output_splits, input_splits, self.group)
        grouped = received.new_zeros(total, x.shape[-1]).index_copy(0, dest, received)
        return grouped, padded_counts, DispatchState(input_splits, output_splits, dest)

    def combine(self, y: torch.Tensor, state: DispatchState) -> torch.Tensor:
        """Reverse of ``dispatch``: rows back to their source ranks, in the order sent."""
        y = y.index_select(0, state.dest)
        return all_to_all_single_autograd(y, state.input_splits, state.output_splits, self.group)
