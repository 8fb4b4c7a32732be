"""Dense SwiGLU feed-forward (TorchTitan's ``FeedForward``: names, layout and init)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from titan_plugins.components.compute_dtype import linear
from titan_plugins.components.init import trunc_normal_

__all__ = ["FeedForward", "trunc_normal_"]  # trunc_normal_: re-exported for plugins that import it from here


class FeedForward(nn.Module):
    """``w2(silu(w1(x)) * w3(x))``; used for dense layers and MoE shared experts.

    ``compute_dtype`` (optional) casts inputs and weights for the matmuls only.
    """

    def __init__(self, dim: int, hidden_dim: int, compute_dtype: torch.dtype | None = None):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)
        self.compute_dtype = compute_dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = self.compute_dtype
        h = F.silu(linear(x, self.w1, dtype)) * linear(x, self.w3, dtype)
        return linear(h, self.w2, dtype)

    def init_weights(self, init_std: float = 0.02) -> None:
        # TorchTitan: w1 always with std 0.02, w2/w3 with the depth-scaled init_std.
        trunc_normal_(self.w1.weight, mean=0.0, std=0.02)
        for lin in (self.w2, self.w3):
            trunc_normal_(lin.weight, mean=0.0, std=init_std)
