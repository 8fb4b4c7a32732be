"""Llama 3: GQA attention with Llama 3.1-scaled rotary embeddings, SwiGLU, RMSNorm.

Same architecture, parameter names, rotary layout (adjacent pairs, complex ``freqs_cis``)
and initialisation as TorchTitan v0.2.2's ``torchtitan/models/llama3``, so a TorchTitan
checkpoint loads as is and gives the same logits; built from the shared components
(``titan_plugins.components``: RoPE, ``GQAttention``, ``DecoderBlock``, ``Decoder``).
Hugging Face extras where config.json states them: attention biases, an explicit
``head_dim`` or SwiGLU size, plain RoPE, tied embeddings (Llama 3.2 1B/3B).
Tensor-parallel surgery lives in ``parallelize.py``; under it the hidden states are
DTensors and only ``inner_attention`` (rotary embedding and kernel) sees plain local
heads, so ``freqs_cis`` stays a plain buffer.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch

from titan_llama3.config import Llama3Config
from titan_plugins.components.decoder import Decoder, DecoderBlock
from titan_plugins.components.feed_forward import FeedForward
from titan_plugins.components.gqa import AttentionMaskT, CausalKernel, GQAttention
from titan_plugins.components.init import depth_scaled_std
from titan_plugins.components.rope import apply_rotary_emb, precompute_freqs_cis

__all__ = ["Llama3Model", "apply_rotary_emb", "build", "precompute_freqs_cis"]


class InnerAttention(CausalKernel):
    """Rotary embedding and the attention kernel on plain (under TP: local) heads.

    ``q``: ``(batch, seq, heads, head_dim)``, ``k``/``v``: ``(batch, seq, kv_heads,
    head_dim)``; returns ``(batch, seq, heads, head_dim)``. Decoding attends to the
    cached positions with the cache's mask.
    """

    def forward(self, q, k, v, freqs_cis: torch.Tensor, mask: AttentionMaskT, cache=None) -> torch.Tensor:
        q, k = apply_rotary_emb(q, freqs_cis), apply_rotary_emb(k, freqs_cis)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        if cache is None:
            return super().forward(q, k, v, mask).transpose(1, 2)
        k, v = cache.update(k, v)
        return self.attend(q, k, v, cache.attention_mask(q.shape[2], q.device)).transpose(1, 2)


class Attention(GQAttention):
    def __init__(self, c: Llama3Config):
        super().__init__(c.dim, c.n_heads, c.kv_heads, c.head_size, bias=c.attention_bias)
        self.inner_attention = InnerAttention(c.attn_backend)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor, mask: AttentionMaskT, cache=None) -> torch.Tensor:
        q, k, v = self.project(x)
        return self.out(self.inner_attention(q, k, v, freqs_cis, mask, **({} if cache is None else {"cache": cache})))


def _block(layer_id: int, c: Llama3Config) -> DecoderBlock:
    attention = Attention(c)  # TorchTitan's construction order: attention, then the FFN
    return DecoderBlock(attention, FeedForward(c.dim, c.ffn_hidden_dim), moe=False, dim=c.dim,
                        norm_eps=c.norm_eps, weight_init_std=depth_scaled_std(layer_id, c.n_layers, c.depth_init))


class Llama3Model(Decoder):
    """The shared ``Decoder`` with a complex, Llama 3.1-scaled ``freqs_cis``."""

    def __init__(self, config: Llama3Config):
        config.check()
        super().__init__(config, lambda i: _block(i, config), rope_buffer="freqs_cis",
                         tie=config.enable_weight_tying)

    def rope_table(self, device: torch.device | None) -> torch.Tensor:
        c = self.config
        with torch.device(device) if device is not None else nullcontext():
            return precompute_freqs_cis(c.head_size, c.max_seq_len, c.rope_theta, c.rope_scaling)


def build(config: Llama3Config) -> Llama3Model:
    """The contract's builder (works under ``torch.device("meta")``)."""
    return Llama3Model(config)
