"""Grouped-query attention modules: the projections (optional biases and per-head
qk-norm) and the causal attention kernel, with TorchTitan's names and init.

A model subclasses ``GQAttention`` for its forward (where its rotary embedding goes,
how it decodes) and keeps these parameter names: ``wq``, ``wk``, ``wv``, ``wo`` and,
with qk-norm, ``q_norm``/``k_norm`` (``nn.RMSNorm`` over ``head_dim``). The kernel
module is named ``inner_attention`` so a TP plan can hand it local heads
(``titan_plugins.distributed.tensor_parallel.gqa_attention_plan``).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.attention.flex_attention import BlockMask, create_block_mask

from titan_plugins.components.attention import AttentionBackend, attend, use_flex
from titan_plugins.components.compute_dtype import linear
from titan_plugins.components.init import trunc_normal_

__all__ = ["AttentionMaskT", "CausalKernel", "GQAttention"]

AttentionMaskT = torch.Tensor | BlockMask | None


class CausalKernel(nn.Module):
    """The attention kernel on ``(batch, heads, seq, head_dim)`` (plain local tensors under TP).

    ``mask``: None for causal attention, a boolean ``(batch, 1, seq, seq)`` mask (SDPA,
    True = attend) or a flex ``BlockMask``. With None the backend decides: flex
    attention (a causal ``BlockMask`` built once per length and device) or SDPA's
    ``is_causal``. ``scale`` None is the kernel's ``head_dim ** -0.5``; ``enable_gqa``
    None infers grouped heads from the shapes.
    """

    def __init__(self, backend: AttentionBackend | str, scale: float | None = None, enable_gqa: bool | None = None):
        super().__init__()
        self.backend, self.scale, self.enable_gqa = backend, scale, enable_gqa
        self._causal: dict[tuple[int, str], BlockMask] = {}

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMaskT) -> torch.Tensor:
        if mask is None and use_flex(self.backend, q.device):
            mask = self._causal_block_mask(q.shape[2], q.device)
        return self.attend(q, k, v, mask)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMaskT) -> torch.Tensor:
        """The kernel call itself with this module's scale and GQA setting (no mask choice)."""
        gqa = q.shape[1] != k.shape[1] if self.enable_gqa is None else self.enable_gqa
        return attend(q, k, v, mask, scale=self.scale, enable_gqa=gqa)

    def _causal_block_mask(self, seqlen: int, device: torch.device) -> BlockMask:
        key = (seqlen, str(device))
        if key not in self._causal:
            self._causal[key] = create_block_mask(
                lambda b, h, q, kv: q >= kv, 1, None, seqlen, seqlen, device=device
            )
        return self._causal[key]


class GQAttention(nn.Module):
    """The parameters of grouped-query attention; subclasses set ``inner_attention`` and
    write ``forward`` (``project`` and ``out`` do the linear parts).

    ``n_heads`` query heads and ``n_kv_heads`` key/value heads of ``head_dim``; ``bias``
    on all four projections (Hugging Face's ``attention_bias``); ``qk_norm_eps`` adds
    per-head ``q_norm``/``k_norm`` RMSNorms (Qwen3), else both are None.
    ``compute_dtype`` (set by ``ComputeDtypeMixin``) casts the projections' matmuls.
    """

    def __init__(
        self, dim: int, n_heads: int, n_kv_heads: int, head_dim: int, *,
        bias: bool = False, qk_norm_eps: float | None = None,
    ):
        super().__init__()
        self.head_dim = head_dim
        self.wq = nn.Linear(dim, n_heads * head_dim, bias=bias)
        self.wk = nn.Linear(dim, n_kv_heads * head_dim, bias=bias)
        self.wv = nn.Linear(dim, n_kv_heads * head_dim, bias=bias)
        self.wo = nn.Linear(n_heads * head_dim, dim, bias=bias)
        with_norm = qk_norm_eps is not None
        self.q_norm = nn.RMSNorm(head_dim, eps=qk_norm_eps) if with_norm else None
        self.k_norm = nn.RMSNorm(head_dim, eps=qk_norm_eps) if with_norm else None
        self.compute_dtype: torch.dtype | None = None

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v as ``(batch, seq, heads, head_dim)``; -1 heads: under TP the projections
        are sharded and the views infer the local (or DTensor) head count."""
        bs, seqlen, _ = x.shape
        dt = self.compute_dtype
        return tuple(linear(x, w, dt).view(bs, seqlen, -1, self.head_dim) for w in (self.wq, self.wk, self.wv))

    def out(self, heads: torch.Tensor) -> torch.Tensor:
        """``wo`` over ``(batch, seq, heads, head_dim)`` attention output."""
        return linear(heads.reshape(*heads.shape[:2], -1), self.wo, self.compute_dtype)

    def init_weights(self, init_std: float) -> None:
        """TorchTitan's order: ``wq``/``wk``/``wv`` truncated normal std 0.02, ``wo`` with the
        block's depth-scaled ``init_std``; biases zero (Hugging Face's start), norms ones."""
        for lin in (self.wq, self.wk, self.wv):
            trunc_normal_(lin.weight, mean=0.0, std=0.02)
        trunc_normal_(self.wo.weight, mean=0.0, std=init_std)
        for lin in (self.wq, self.wk, self.wv, self.wo):
            if lin.bias is not None:
                nn.init.zeros_(lin.bias)
        for norm in (self.q_norm, self.k_norm):
            if norm is not None:
                norm.reset_parameters()
