"""Routed experts: SwiGLU per expert over tokens grouped by expert.

Weights use TorchTitan's layout and names: ``w1``/``w3`` ``(E, hidden, dim)`` and
``w2`` ``(E, dim, hidden)``. ``torch._grouped_mm`` (works on CPU and CUDA in torch
2.13, forward and backward) computes all experts in three grouped GEMMs; where it is
missing or ``use_grouped_mm=False``, a per-expert loop gives the same result.
Under parallelism the weights are DTensors and the math runs on their local shards.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from titan_plugins.components.compute_dtype import cast
from titan_plugins.components.init import trunc_normal_

HAS_GROUPED_MM = hasattr(torch, "_grouped_mm")


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def run_experts_grouped_mm(
    w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor, x: torch.Tensor, counts: torch.Tensor
) -> torch.Tensor:
    """``x`` rows grouped by expert, ``counts[e]`` rows for expert ``e`` (sum = rows)."""
    offs = torch.cumsum(counts, dim=0, dtype=torch.int32)
    h = F.silu(torch._grouped_mm(x, w1.transpose(-2, -1), offs=offs))
    h = h * torch._grouped_mm(x, w3.transpose(-2, -1), offs=offs)
    return torch._grouped_mm(h, w2.transpose(-2, -1), offs=offs)


def run_experts_loop(
    w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor, x: torch.Tensor, counts: torch.Tensor
) -> torch.Tensor:
    """Same contract as ``run_experts_grouped_mm``, one matmul chain per expert."""
    outs = []
    for e, x_e in enumerate(torch.split(x, counts.tolist(), dim=0)):
        h = F.silu(x_e @ w1[e].transpose(-2, -1)) * (x_e @ w3[e].transpose(-2, -1))
        outs.append(h @ w2[e].transpose(-2, -1))
    return torch.cat(outs, dim=0)


class GroupedExperts(nn.Module):
    def __init__(
        self,
        dim: int,
        hidden_dim: int,
        num_experts: int,
        use_grouped_mm: bool = True,
        compute_dtype: torch.dtype | None = None,
    ):
        super().__init__()
        self.num_experts = num_experts
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.use_grouped_mm = use_grouped_mm and HAS_GROUPED_MM
        self.compute_dtype = compute_dtype

    @property
    def grouped_mm_path(self) -> str:
        return "torch._grouped_mm" if self.use_grouped_mm else "per-expert loop"

    def forward(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """``x``: ``(rows, dim)`` grouped by (local) expert; ``num_tokens_per_expert``:
        int ``(local experts,)`` summing to ``rows``. Returns ``(rows, dim)`` in the
        compute dtype (``x``'s dtype when none is set)."""
        dtype = self.compute_dtype or x.dtype
        w1, w2, w3 = (cast(_local(w), dtype) for w in (self.w1, self.w2, self.w3))
        run = run_experts_grouped_mm if self._grouped_mm_fits(w1, w2) else run_experts_loop
        return run(w1, w2, w3, cast(x, dtype), num_tokens_per_expert)

    def _grouped_mm_fits(self, w1: torch.Tensor, w2: torch.Tensor) -> bool:
        # torch._grouped_mm needs 16-byte aligned row strides (dim and hidden). Under
        # torch.compile its fake-tensor kernel accepts bf16 only (torch 2.13; eager CPU
        # runs fp32 too), so a compiled fp32 block takes the per-expert loop.
        if torch.compiler.is_compiling() and w1.dtype != torch.bfloat16:
            return False
        esize = w1.element_size()
        return (
            self.use_grouped_mm
            and (w1.shape[-1] * esize) % 16 == 0
            and (w2.shape[-1] * esize) % 16 == 0
        )

    def init_weights(self, init_std: float) -> None:
        # TorchTitan: w1 with std 0.02, w2/w3 with the depth-scaled init_std.
        trunc_normal_(self.w1, mean=0.0, std=0.02)
        trunc_normal_(self.w2, mean=0.0, std=init_std)
        trunc_normal_(self.w3, mean=0.0, std=init_std)
