"""Qwen3: GQA attention with per-head q/k RMSNorm, rotary embeddings, SwiGLU or MoE.

Same architecture, parameter names and initialisation as TorchTitan v0.2.2's
``torchtitan/models/qwen3`` (a TorchTitan checkpoint loads as is), built from the
shared components (``titan_plugins.components``: rotate-half RoPE, ``GQAttention``,
``DecoderBlock``, ``Decoder``). Tensor-parallel surgery lives in ``parallelize.py``;
this file only keeps the shapes DTensor-friendly (the rotary cache meets the
projections as a replicated DTensor, the kernel gets local heads).
"""

from __future__ import annotations

import torch

from titan_plugins.components.decoder import Decoder, DecoderBlock
from titan_plugins.components.feed_forward import FeedForward
from titan_plugins.components.gqa import AttentionMaskT, CausalKernel, GQAttention
from titan_plugins.components.init import depth_scaled_std
from titan_plugins.components.moe import MoE
from titan_plugins.components.rope import apply_rotary, rope_cache
from titan_qwen3.config import Qwen3Config

__all__ = ["Attention", "Qwen3Model", "apply_rotary", "build", "rope_cache"]


class Attention(GQAttention):
    """qk-norm before the rotary embedding, which runs on the (DTensor) heads."""

    def __init__(self, c: Qwen3Config):
        super().__init__(c.dim, c.n_heads, c.n_kv_heads, c.head_dim, qk_norm_eps=c.norm_eps if c.qk_norm else None)
        self.inner_attention = CausalKernel(c.attn_backend, c.head_dim**-0.5, c.n_heads > c.n_kv_heads)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, mask: AttentionMaskT, cache=None) -> torch.Tensor:
        xq, xk, xv = self.project(x)
        if self.q_norm is not None:
            xq, xk = self.q_norm(xq), self.k_norm(xk)
        xq, xk = apply_rotary(xq, xk, rope)
        xq, xk, xv = xq.transpose(1, 2), xk.transpose(1, 2), xv.transpose(1, 2)
        if cache is not None:  # decoding: attend to the cached positions too
            xk, xv = cache.update(xk, xv)
        return self.out(self.inner_attention(xq, xk, xv, mask).transpose(1, 2))


def _block(layer_id: int, c: Qwen3Config) -> DecoderBlock:
    # Built in TorchTitan's order (attention, then the FFN). With MoE enabled a block is
    # MoE unless the layer schedule makes it dense (Qwen3Config.is_moe_layer).
    attention = Attention(c)
    moe = c.is_moe_layer(layer_id)
    ffn = MoE(c.moe, dim=c.dim, hidden_dim=c.moe_inter_dim) if moe else FeedForward(c.dim, c.hidden_dim)
    return DecoderBlock(attention, ffn, moe=moe, dim=c.dim, norm_eps=c.norm_eps,
                        weight_init_std=depth_scaled_std(layer_id, c.n_layers, c.depth_init))


class Qwen3Model(Decoder):
    """The shared ``Decoder`` with a rotate-half ``rope_cache``; logits computed in the
    output weight's dtype (TorchTitan's Qwen3)."""

    def __init__(self, config: Qwen3Config):
        config.check()
        super().__init__(config, lambda i: _block(i, config), rope_buffer="rope_cache",
                         tie=config.enable_weight_tying)

    def rope_table(self, device: torch.device | None) -> torch.Tensor:
        c = self.config
        return rope_cache(c.head_dim, c.max_seq_len, c.rope_theta, device=device)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        if self.compute_dtype is not None:
            h = h.to(self.output.weight.dtype)
        return self.output(h)

    def decode_mask(self, tokens: torch.Tensor, cache) -> AttentionMaskT:
        return cache.attention_mask(tokens.shape[1], tokens.device)


def build(config: Qwen3Config) -> Qwen3Model:
    """The contract's builder (works under ``torch.device("meta")``)."""
    return Qwen3Model(config)
