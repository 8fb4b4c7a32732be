"""Llama 4 text decoder, numerically equal to TorchTitan v0.2.2's ``models/llama4``.

GQA attention with Llama-scaled rotary embeddings, optional iRoPE (every n-th layer
without rotary embedding and with full causal attention, chunked local attention
elsewhere), optional document masking (``block_causal``: no attention across an
``eos_id``, as in TorchTitan's irope flavors), and dense SwiGLU blocks interleaved with MoE blocks (shared component).
Parameter names, shapes and the init scheme are TorchTitan's, so its checkpoints
load as they are. Hugging Face's Llama 4 extras (qk L2-norm, query temperature on
NoPE layers, its NoPE placement) are config options, off in TorchTitan's flavors. Tensor parallelism is installed from outside (``parallelize.py``);
under it the hidden states are DTensors and only ``inner_attention`` (rotary
embedding + kernel) sees plain local tensors.
"""

from __future__ import annotations

import functools
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch import nn

from titan_llama4.config import AttentionMask, Llama4Config
from titan_plugins.components.attention import attend, use_flex
from titan_plugins.components.attention_masks import block_mask, dense_mask
from titan_plugins.components.cp_attention import current_shard, global_seq_len, token_positions
from titan_plugins.components.decoder import Decoder, DecoderBlock
from titan_plugins.components.feed_forward import FeedForward
from titan_plugins.components.gqa import GQAttention
from titan_plugins.components.init import depth_scaled_std
from titan_plugins.components.moe import MoE
from titan_plugins.components.rope import apply_rotary_emb, precompute_freqs_cis

__all__ = ["Llama4", "build", "precompute_freqs_cis"]


# --------------------------------------------------------------- attention
@functools.lru_cache(maxsize=16)
def _document_free_mask(seq_len: int, chunk: int, device: torch.device, flex: bool, shard=None):
    """Chunked-causal mask without documents: the same for every batch, cached (per
    context-parallel ``shard`` too: its queries are that rank's positions)."""
    return (block_mask if flex else dense_mask)(None, seq_len, chunk, device)


class InnerAttention(nn.Module):
    """Rotary embedding and the attention kernel, on plain (local) tensors.

    ``q``: ``(batch, seq, heads, head_dim)``, ``k``/``v``: ``(batch, seq, kv_heads,
    head_dim)``; returns ``(batch, seq, heads, head_dim)``. ``doc``: per-token
    document ids for ``block_causal`` attention (None: plain causal). Causal layers
    without documents use SDPA's ``is_causal``; masked layers (chunks, documents) use
    flex attention on CUDA (``auto``/``flex``) or SDPA with the same mask as a boolean
    tensor (flex attention has no CPU backward).

    Hugging Face's Llama 4 extras (``Llama4TextAttention``): ``qk_norm_eps`` L2-normalises
    q and k after RoPE; ``temperature`` ``(floor_scale, attn_scale)`` scales the queries
    of a NoPE layer by ``1 + attn_scale * log1p(floor((position + 1) / floor_scale))``.
    """

    def __init__(
        self,
        use_rope: bool,
        chunk_size: int | None,
        backend: str,
        qk_norm_eps: float | None = None,
        temperature: tuple[int, float] | None = None,
    ):
        super().__init__()
        self.use_rope = use_rope
        self.chunk_size = chunk_size
        self.backend = backend
        self.qk_norm_eps = qk_norm_eps if use_rope else None
        self.temperature = None if use_rope else temperature

    def forward(self, q, k, v, freqs_cis: torch.Tensor, doc: torch.Tensor | None = None, cache=None) -> torch.Tensor:
        if self.use_rope:
            q, k = apply_rotary_emb(q, freqs_cis), apply_rotary_emb(k, freqs_cis)
        if self.qk_norm_eps is not None:
            q, k = (F.rms_norm(t.float(), (t.shape[-1],), eps=self.qk_norm_eps).type_as(t) for t in (q, k))
        if self.temperature is not None:
            q = self._tune_temperature(q, cache.parent.pos if cache is not None else 0)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        gqa = q.shape[1] != k.shape[1]
        seq = q.shape[2]  # (the whole row's length under context parallelism, below)
        if cache is not None:  # decoding: the cached positions too, chunked mask by position
            k, v = cache.update(k, v)
            mask = cache.attention_mask(seq, q.device, self.chunk_size)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=gqa)
            return out.transpose(1, 2)
        seq = global_seq_len(seq)
        chunk = self.chunk_size if self.chunk_size is not None and self.chunk_size < seq else None
        if chunk is None and doc is None:
            return attend(q, k, v, None, enable_gqa=gqa).transpose(1, 2)  # SDPA's is_causal
        flex = use_flex(self.backend, q.device)
        if doc is None:
            mask = _document_free_mask(seq, chunk, q.device, flex, current_shard())
        else:
            mask = (block_mask if flex else dense_mask)(doc, seq, chunk, q.device)
        return attend(q, k, v, mask, enable_gqa=gqa).transpose(1, 2)

    def _tune_temperature(self, q: torch.Tensor, start: int) -> torch.Tensor:
        floor_scale, attn_scale = self.temperature
        positions = token_positions(q.shape[1], q.device).to(torch.float32) + start
        scales = torch.log1p(torch.floor((positions + 1.0) / floor_scale)) * attn_scale + 1.0
        return (q * scales.view(1, -1, 1, 1)).to(q.dtype)


class Attention(GQAttention):
    def __init__(self, config: Llama4Config, layer_id: int):
        super().__init__(config.dim, config.n_heads, config.kv_heads, config.head_dim)
        self.inner_attention = InnerAttention(
            config.uses_rope(layer_id),
            config.attn_chunk_size(layer_id),
            config.attn_backend.value,
            qk_norm_eps=config.norm_eps if config.qk_norm else None,
            temperature=(config.floor_scale, config.attn_scale) if config.attn_temperature_tuning else None,
        )

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor, doc: torch.Tensor | None = None, cache=None) -> torch.Tensor:
        q, k, v = self.project(x)
        return self.out(self.inner_attention(q, k, v, freqs_cis, doc, cache))


def _block(config: Llama4Config, layer_id: int) -> DecoderBlock:
    attention = Attention(config, layer_id)  # TorchTitan's construction order: attention, then the FFN
    moe = config.is_moe_layer(layer_id)
    ffn = MoE(config.moe, dim=config.dim, hidden_dim=config.moe_hidden_dim) if moe else FeedForward(
        config.dim, config.ffn_hidden_dim)
    return DecoderBlock(attention, ffn, moe=moe, dim=config.dim, norm_eps=config.norm_eps,
                        weight_init_std=depth_scaled_std(layer_id, config.n_layers, config.depth_init))


class Llama4(Decoder):
    """The shared ``Decoder``; its blocks get the document ids (not a mask): each layer
    builds its own (chunked or full) mask."""

    def __init__(self, config: Llama4Config):
        config.check()
        super().__init__(config, lambda i: _block(config, i), rope_buffer="freqs_cis")

    def rope_table(self, device: torch.device | None) -> torch.Tensor:
        c = self.config
        with torch.device(device) if device is not None else nullcontext():
            return precompute_freqs_cis(c.head_dim, c.max_seq_len, c.rope_theta, c.rope_scaling)

    def attention_mask(self, doc_ids: torch.Tensor | None) -> torch.Tensor | None:
        if doc_ids is None and self.tok_embeddings is None and self.config.attn_mask is AttentionMask.block_causal:
            raise ValueError(
                "model.attn_mask=block_causal: a later pipeline stage needs doc_ids "
                "(the trainer passes stage_inputs)"
            )
        return doc_ids


def build(config: Llama4Config) -> Llama4:
    """The model for ``config`` (call under ``torch.device("meta")``, then
    ``to_empty`` and ``init_weights``)."""
    return Llama4(config)
