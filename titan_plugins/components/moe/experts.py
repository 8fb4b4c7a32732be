"""Routed experts: SwiGLU per expert over tokens grouped by expert.

Weights use TorchTitan's layout and names: ``w1``/``w3`` ``(E, hidden, dim)`` and
``w2`` ``(E, dim, hidden)``. ``torch._grouped_mm`` (works on CPU and CUDA in torch
2.13, forward and backward) computes all experts in three grouped GEMMs; where it is
missing or ``use_grouped_mm=False``, a per-expert loop gives the same result.
Under parallelism the weights are DTensors and the math runs on their local shards.

LoRA on the experts (``titan_plugins.peft``) hangs its per-expert adapters under
``lora`` and hands them to the same machinery as :class:`LowRank` updates: each expert's
rows get ``scaling * B_e A_e x`` added to ``W_e x``, computed with the grouped GEMMs (or
the loop) on the rows routed to that expert. Without adapters the math is unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from titan_plugins.components.compute_dtype import cast
from titan_plugins.components.init import trunc_normal_

HAS_GROUPED_MM = hasattr(torch, "_grouped_mm")


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


@dataclass(frozen=True)
class LowRank:
    """A per-expert low-rank update of one expert weight ``W`` ``[E, out, in]``: plain
    local tensors ``a`` ``[E, r, in]`` and ``b`` ``[E, out, r]`` in the compute dtype;
    ``W_e x`` becomes ``W_e x + scaling * b_e a_e dropout(x)``."""

    a: torch.Tensor
    b: torch.Tensor
    scaling: float
    dropout: Callable[[torch.Tensor], torch.Tensor] | None = None

    def expert(self, e: int) -> LowRank:
        return LowRank(self.a[e], self.b[e], self.scaling, self.dropout)


Adapters = Mapping[str, LowRank]  # by expert weight name: "w1", "w2", "w3"

_MatMul = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _project(mm: _MatMul, x: torch.Tensor, w: torch.Tensor, low: LowRank | None) -> torch.Tensor:
    """``mm(x, w)`` (``x W^T`` per expert), plus the low-rank path through the same ``mm``."""
    y = mm(x, w)
    if low is None:
        return y
    h = x if low.dropout is None else low.dropout(x)
    return y + mm(mm(h, low.a), low.b) * low.scaling


def run_experts_grouped_mm(
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor,
    x: torch.Tensor,
    counts: torch.Tensor,
    adapters: Adapters | None = None,
) -> torch.Tensor:
    """``x`` rows grouped by expert, ``counts[e]`` rows for expert ``e`` (sum = rows).
    ``adapters``: low-rank updates of some of ``w1``/``w2``/``w3`` (module docstring)."""
    offs = torch.cumsum(counts, dim=0, dtype=torch.int32)
    low = adapters or {}

    def mm(inp: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch._grouped_mm(inp, w.transpose(-2, -1), offs=offs)

    h = F.silu(_project(mm, x, w1, low.get("w1")))
    h = h * _project(mm, x, w3, low.get("w3"))
    return _project(mm, h, w2, low.get("w2"))


def _matmul(inp: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return inp @ w.transpose(-2, -1)


def run_experts_loop(
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor,
    x: torch.Tensor,
    counts: torch.Tensor,
    adapters: Adapters | None = None,
) -> torch.Tensor:
    """Same contract as ``run_experts_grouped_mm``, one matmul chain per expert."""
    low = adapters or {}
    outs = []
    for e, x_e in enumerate(torch.split(x, counts.tolist(), dim=0)):
        at = {name: update.expert(e) for name, update in low.items()}
        h = F.silu(_project(_matmul, x_e, w1[e], at.get("w1"))) * _project(_matmul, x_e, w3[e], at.get("w3"))
        outs.append(_project(_matmul, h, w2[e], at.get("w2")))
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

    def forward(
        self,
        x: torch.Tensor,
        num_tokens_per_expert: torch.Tensor,
        grad_sync: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """``x``: ``(rows, dim)`` grouped by (local) expert; ``num_tokens_per_expert``:
        int ``(local experts,)`` summing to ``rows``. Returns ``(rows, dim)`` in the
        compute dtype (``x``'s dtype when none is set). ``grad_sync``: under tensor-
        parallel experts, identity whose backward sums over the tp peers (for adapter
        halves replicated over tp, see :meth:`low_rank`)."""
        dtype = self.compute_dtype or x.dtype
        w1, w2, w3 = (cast(_local(w), dtype) for w in (self.w1, self.w2, self.w3))
        adapters = self.low_rank(dtype, grad_sync)
        run = run_experts_grouped_mm if self._grouped_mm_fits(w1, w2, adapters) else run_experts_loop
        return run(w1, w2, w3, cast(x, dtype), num_tokens_per_expert, adapters)

    def low_rank(
        self, dtype: torch.dtype, grad_sync: Callable[[torch.Tensor], torch.Tensor] | None = None
    ) -> Adapters | None:
        """The experts' low-rank updates as local tensors in ``dtype``; none here (LoRA,
        ``titan_plugins.peft``, overrides it). Under tensor-parallel experts (``w1``/``w3``
        sharded on their output rows, ``w2`` on its input columns) the adapter half that
        stays whole on every tp rank (``A`` of ``w1``/``w3``, ``B`` of ``w2``) gets a partial
        gradient there and goes through ``grad_sync``."""
        return None

    def adapters(self) -> dict[str, nn.Module]:
        """``{expert weight name: adapter pair}`` that LoRA hung under ``lora`` (each with
        ``lora_A.weight`` ``[E, r, in]`` and ``lora_B.weight`` ``[E, out, r]``); empty
        without. ``apply_moe_parallel`` shards them like their weight."""
        lora = self._modules.get("lora")
        return dict(lora.items()) if lora is not None else {}

    def _grouped_mm_fits(self, w1: torch.Tensor, w2: torch.Tensor, adapters: Adapters | None = None) -> bool:
        # torch._grouped_mm needs 16-byte aligned row strides (dim and hidden; with
        # adapters their rank too). Under torch.compile its fake-tensor kernel accepts
        # bf16 only (torch 2.13; eager CPU runs fp32 too), so a compiled fp32 block
        # takes the per-expert loop.
        if torch.compiler.is_compiling() and w1.dtype != torch.bfloat16:
            return False
        esize = w1.element_size()
        ranks = [low.a.shape[-2] for low in adapters.values()] if adapters else []
        return (
            self.use_grouped_mm
            and (w1.shape[-1] * esize) % 16 == 0
            and (w2.shape[-1] * esize) % 16 == 0
            and all((r * esize) % 16 == 0 for r in ranks)
        )

    def init_weights(self, init_std: float) -> None:
        # TorchTitan: w1 with std 0.02, w2/w3 with the depth-scaled init_std.
        trunc_normal_(self.w1, mean=0.0, std=0.02)
        trunc_normal_(self.w2, mean=0.0, std=init_std)
        trunc_normal_(self.w3, mean=0.0, std=init_std)
