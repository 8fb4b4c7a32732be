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
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import BlockMask, create_block_mask

from titan_plugins.components.attention import AttentionBackend, attend, flex_kernel, use_flex
from titan_plugins.components.compute_dtype import linear
from titan_plugins.components.init import trunc_normal_

__all__ = ["AttentionMaskT", "CausalKernel", "GQAttention", "SinkKernel"]

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


class SinkKernel(CausalKernel):
    """``CausalKernel`` with attention sinks (GPT-OSS): one learnable logit per query head
    joins every softmax and takes its share of the probability mass, attending to nothing.

    ``softmax([scores, sink])`` without the sink's column equals the plain attention
    output times ``sigmoid(lse - sink)``, ``lse`` the log-sum-exp of the row's scores.
    A flex ``BlockMask`` runs flex attention with ``return_lse``; otherwise the scores are
    computed eagerly (``(batch, heads, seq, kv)`` in memory, as transformers' eager
    GPT-OSS attention). Under TP the ``sinks`` (per head) are sharded like the heads
    (``LocalAttention`` shards a kernel's parameters on dim 0).
    """

    def __init__(self, backend: AttentionBackend | str, n_heads: int, scale: float | None = None):
        super().__init__(backend, scale)
        self.sinks = nn.Parameter(torch.empty(n_heads))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMaskT) -> torch.Tensor:
        from titan_plugins.components.cp_attention import current_shard

        if current_shard() is not None:
            raise ValueError("attention sinks (SinkKernel) do not run under context parallelism (parallelism.cp)")
        sinks = self.sinks.to_local() if hasattr(self.sinks, "to_local") else self.sinks
        if sinks.shape[0] != q.shape[1]:
            raise ValueError(f"attention sinks: {sinks.shape[0]} sinks for {q.shape[1]} query heads")
        scale = q.shape[-1] ** -0.5 if self.scale is None else self.scale
        gqa = q.shape[1] != k.shape[1]
        if isinstance(mask, BlockMask):
            out, lse = flex_kernel(q.device)(q, k, v, block_mask=mask, scale=scale, enable_gqa=gqa, return_lse=True)
            return out * torch.sigmoid(lse - sinks.view(1, -1, 1)).unsqueeze(-1).to(out.dtype)
        if gqa:
            k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
        scores = (q @ k.transpose(-2, -1)) * scale
        if mask is None:  # causal; queries are the last positions when decoding
            mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril(k.shape[2] - q.shape[2])
        scores = scores.masked_fill(~mask, float("-inf"))
        sink = sinks.view(1, -1, 1, 1).to(scores.dtype).expand(*scores.shape[:-1], 1)
        probs = F.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
        return probs.to(v.dtype) @ v

    def init_weights(self, std: float = 0.02) -> None:
        trunc_normal_(self.sinks, mean=0.0, std=std)


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
