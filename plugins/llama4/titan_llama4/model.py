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
import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from titan_llama4.config import AttentionMask, Llama4Config, RoPEScaling
from titan_plugins.components.attention import attend, use_flex
from titan_plugins.components.attention_masks import block_mask, dense_mask, document_ids
from titan_plugins.components.compute_dtype import ComputeDtypeMixin, cast, linear
from titan_plugins.components.feed_forward import FeedForward
from titan_plugins.components.init import (
    depth_scaled_std,
    init_block_,
    init_decoder_,
    trunc_normal_,
)
from titan_plugins.components.moe import MoE

__all__ = ["Llama4", "build", "precompute_freqs_cis"]


# ------------------------------------------------------------------ rotary
def precompute_freqs_cis(
    head_dim: int, end: int, theta: float, scaling: RoPEScaling
) -> torch.Tensor:
    """complex64 ``(end, head_dim // 2)``; with scaling, wavelengths beyond the original
    context are divided by ``scaling_factor`` and the band in between interpolated."""
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2)[: head_dim // 2].float() / head_dim))
    if scaling.enabled:
        factor, orig = scaling.scaling_factor, scaling.original_max_position_embeddings
        low, high = scaling.low_freq_factor, scaling.high_freq_factor
        wavelen = 2 * math.pi / freqs
        freqs = torch.where(wavelen > orig / low, freqs / factor, freqs)
        # With low == high (the defaults) the band is empty; the 0/0 it computes is discarded.
        smooth = (orig / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * freqs / factor + smooth * freqs
        medium = ~(wavelen < orig / high) * ~(wavelen > orig / low)
        freqs = torch.where(medium, smoothed, freqs)
    angles = torch.outer(torch.arange(end, device=freqs.device), freqs).float()
    return torch.polar(torch.ones_like(angles), angles)


def apply_rotary_emb(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    """``x``: ``(batch, seq, heads, head_dim)``, adjacent pairs rotated (TorchTitan layout)."""
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    out = torch.view_as_real(xc * freqs_cis[: x.shape[1]].view(1, x.shape[1], 1, -1)).flatten(3)
    return out.type_as(x)


# --------------------------------------------------------------- attention
@functools.lru_cache(maxsize=16)
def _document_free_mask(seq_len: int, chunk: int, device: torch.device, flex: bool):
    """Chunked-causal mask without documents: the same for every batch, cached."""
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
        seq = q.shape[2]
        if cache is not None:  # decoding: the cached positions too, chunked mask by position
            k, v = cache.update(k, v)
            mask = cache.attention_mask(seq, q.device, self.chunk_size)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=gqa)
            return out.transpose(1, 2)
        chunk = self.chunk_size if self.chunk_size is not None and self.chunk_size < seq else None
        if chunk is None and doc is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa).transpose(1, 2)
        flex = use_flex(self.backend, q.device)
        if doc is None:
            mask = _document_free_mask(seq, chunk, q.device, flex)
        else:
            mask = (block_mask if flex else dense_mask)(doc, seq, chunk, q.device)
        return attend(q, k, v, mask, enable_gqa=gqa).transpose(1, 2)

    def _tune_temperature(self, q: torch.Tensor, start: int) -> torch.Tensor:
        floor_scale, attn_scale = self.temperature
        positions = torch.arange(start, start + q.shape[1], device=q.device, dtype=torch.float32)
        scales = torch.log1p(torch.floor((positions + 1.0) / floor_scale)) * attn_scale + 1.0
        return (q * scales.view(1, -1, 1, 1)).to(q.dtype)


class Attention(nn.Module):
    def __init__(self, config: Llama4Config, layer_id: int):
        super().__init__()
        self.head_dim = hd = config.head_dim
        self.wq = nn.Linear(config.dim, config.n_heads * hd, bias=False)
        self.wk = nn.Linear(config.dim, config.kv_heads * hd, bias=False)
        self.wv = nn.Linear(config.dim, config.kv_heads * hd, bias=False)
        self.wo = nn.Linear(config.n_heads * hd, config.dim, bias=False)
        self.inner_attention = InnerAttention(
            config.uses_rope(layer_id),
            config.attn_chunk_size(layer_id),
            config.attn_backend.value,
            qk_norm_eps=config.norm_eps if config.qk_norm else None,
            temperature=(config.floor_scale, config.attn_scale) if config.attn_temperature_tuning else None,
        )
        self.compute_dtype: torch.dtype | None = None

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor, doc: torch.Tensor | None = None, cache=None) -> torch.Tensor:
        bs, seq, _ = x.shape
        dt = self.compute_dtype
        # -1: the local head count under TP (or the global one on a DTensor).
        q = linear(x, self.wq, dt).view(bs, seq, -1, self.head_dim)
        k = linear(x, self.wk, dt).view(bs, seq, -1, self.head_dim)
        v = linear(x, self.wv, dt).view(bs, seq, -1, self.head_dim)
        out = self.inner_attention(q, k, v, freqs_cis, doc, cache)
        return linear(out.reshape(bs, seq, -1), self.wo, dt)

    def init_weights(self, init_std: float) -> None:
        for lin in (self.wq, self.wk, self.wv):
            trunc_normal_(lin.weight, mean=0.0, std=0.02)
        trunc_normal_(self.wo.weight, mean=0.0, std=init_std)


# ------------------------------------------------------------------- blocks
def _like(out: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """Bring a DTensor branch output to the residual's layout (a no-op when a TP plan's
    output hook already did; needed when compute-dtype casts bypass module hooks)."""
    if (
        isinstance(out, DTensor)
        and isinstance(residual, DTensor)
        and out.placements != residual.placements
    ):
        return out.redistribute(placements=residual.placements)
    return out


class TransformerBlock(nn.Module):
    def __init__(self, config: Llama4Config, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.attention = Attention(config, layer_id)
        self.moe_enabled = config.is_moe_layer(layer_id)
        if self.moe_enabled:
            self.moe = MoE(config.moe, dim=config.dim, hidden_dim=config.moe_hidden_dim)
        else:
            self.feed_forward = FeedForward(config.dim, config.ffn_hidden_dim)
        self.attention_norm = nn.RMSNorm(config.dim, eps=config.norm_eps)
        self.ffn_norm = nn.RMSNorm(config.dim, eps=config.norm_eps)
        self.weight_init_std = depth_scaled_std(layer_id, config.n_layers, config.depth_init)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor, doc: torch.Tensor | None = None, cache=None) -> torch.Tensor:
        # cache only as a keyword, and only when decoding: a TP plan's input layouts cover the training call
        kw = {} if cache is None else {"cache": cache}
        h = x + _like(self.attention(self.attention_norm(x), freqs_cis, doc, **kw), x)
        ffn = self.moe if self.moe_enabled else self.feed_forward
        return h + _like(ffn(self.ffn_norm(h)), h)

    def init_weights(self, buffer_device: torch.device | None) -> None:
        init_block_(self, buffer_device)


# -------------------------------------------------------------------- model
class Llama4(ComputeDtypeMixin, nn.Module):
    """``forward(tokens)``: ids ``(batch, seq)`` on the first pipeline stage, hidden
    states ``(batch, seq, dim)`` on later ones; logits ``(batch, seq, vocab)`` on the
    last stage, else hidden states. ``tok_embeddings``/``norm``/``output`` may be None."""

    def __init__(self, config: Llama4Config):
        super().__init__()
        config.check()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.register_buffer("freqs_cis", self._precompute_freqs_cis(), persistent=False)
        self.layers = nn.ModuleDict(
            {str(i): TransformerBlock(config, i) for i in range(config.n_layers)}
        )
        self.norm = nn.RMSNorm(config.dim, eps=config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        self.compute_dtype: torch.dtype | None = None

    def _precompute_freqs_cis(self) -> torch.Tensor:
        c = self.config
        return precompute_freqs_cis(c.head_dim, c.max_seq_len, c.rope_theta, c.rope_scaling)

    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        """TorchTitan's scheme and order; rebuilds ``freqs_cis`` on ``buffer_device``."""
        buffer_device = buffer_device or self.freqs_cis.device
        with torch.device(buffer_device):
            self.freqs_cis = self._precompute_freqs_cis()
        init_decoder_(self, buffer_device, self.output, self.config.dim)

    def stage_inputs(self, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
        """What every pipeline stage needs from the token ids (``PipelineInfo.stage_inputs``):
        the document ids of a ``block_causal`` mask; nothing for causal attention."""
        if self.config.attn_mask is AttentionMask.causal:
            return {}
        return {"doc_ids": document_ids(tokens, self.config.eos_id)}

    def forward(self, tokens: torch.Tensor, doc_ids: torch.Tensor | None = None, cache=None) -> torch.Tensor:
        """Token ids (first stage) or hidden states; ``doc_ids`` only on later pipeline
        stages under ``block_causal`` (the first stage derives them from the ids).
        ``cache``: a ``titan_plugins.generate.KVCache`` (single stage, decoding only)."""
        if cache is not None:
            h = self.tok_embeddings(tokens)
            for name, layer in self.layers.items():
                h = layer(h, self.freqs_cis[cache.pos :], None, cache.layer(name))
            return linear(cast(self.norm(h), self.compute_dtype), self.output, self.compute_dtype)
        seq = tokens.shape[1]
        if seq > self.freqs_cis.shape[0]:
            raise ValueError(
                f"sequence length {seq} exceeds model.max_seq_len={self.freqs_cis.shape[0]} "
                "(the rotary cache length); raise model.max_seq_len"
            )
        if self.tok_embeddings is not None:
            if doc_ids is None:
                doc_ids = self.stage_inputs(tokens).get("doc_ids")
            h = self.tok_embeddings(tokens)
        else:
            h = tokens
            if doc_ids is None and self.config.attn_mask is AttentionMask.block_causal:
                raise ValueError(
                    "model.attn_mask=block_causal: a later pipeline stage needs doc_ids "
                    "(the trainer passes stage_inputs)"
                )
        for layer in self.layers.values():
            if layer is not None:
                h = layer(h, self.freqs_cis, doc_ids)
        if self.norm is not None:
            h = self.norm(h)
        if self.output is None:
            return h
        return linear(cast(h, self.compute_dtype), self.output, self.compute_dtype)


def build(config: Llama4Config) -> Llama4:
    """The model for ``config`` (call under ``torch.device("meta")``, then
    ``to_empty`` and ``init_weights``)."""
    return Llama4(config)
