"""Llama 3: GQA attention with Llama 3.1-scaled rotary embeddings, SwiGLU, RMSNorm.

Same architecture, parameter names, rotary layout (adjacent pairs, complex ``freqs_cis``)
and initialisation as TorchTitan v0.2.2's ``torchtitan/models/llama3``, so a TorchTitan
checkpoint loads as is and gives the same logits. Hugging Face extras where config.json
states them: attention biases, an explicit ``head_dim`` or SwiGLU size, plain RoPE,
tied embeddings (Llama 3.2 1B/3B). Tensor-parallel surgery lives in ``parallelize.py``;
under it the hidden states are DTensors and only ``inner_attention`` (rotary embedding
and kernel) sees plain local heads, so ``freqs_cis`` stays a plain buffer.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn.attention.flex_attention import BlockMask, create_block_mask

from titan_llama3.config import AttentionMask, Llama3Config, RoPEScaling
from titan_plugins.components.attention import AttentionBackend, attend, use_flex
from titan_plugins.components.attention_masks import block_mask, dense_mask, document_ids
from titan_plugins.components.compute_dtype import ComputeDtypeMixin, cast, linear
from titan_plugins.components.feed_forward import FeedForward
from titan_plugins.components.init import (
    depth_scaled_std,
    init_block_,
    init_decoder_,
    trunc_normal_,
)

__all__ = ["Llama3Model", "apply_rotary_emb", "build", "precompute_freqs_cis"]

AttentionMaskT = torch.Tensor | BlockMask | None


# ------------------------------------------------------------------ rotary
def precompute_freqs_cis(head_dim: int, end: int, theta: float, scaling: RoPEScaling) -> torch.Tensor:
    """complex64 ``(end, head_dim // 2)`` (TorchTitan's ``precompute_freqs_cis``): with
    scaling, wavelengths beyond ``original_max_position_embeddings / low_freq_factor``
    are divided by ``scaling_factor``, those below ``/ high_freq_factor`` kept, the band
    in between interpolated (Llama 3.1's scheme, Hugging Face's ``rope_type: llama3``)."""
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2)[: head_dim // 2].float() / head_dim))
    if scaling.enabled:
        factor, orig = scaling.scaling_factor, scaling.original_max_position_embeddings
        low, high = scaling.low_freq_factor, scaling.high_freq_factor
        wavelen = 2 * math.pi / freqs
        freqs = torch.where(wavelen > orig / low, freqs / factor, freqs)
        smooth = (orig / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * freqs / factor + smooth * freqs
        medium = ~(wavelen < orig / high) * ~(wavelen > orig / low)
        freqs = torch.where(medium, smoothed, freqs)
    angles = torch.outer(torch.arange(end, device=freqs.device), freqs).float()
    return torch.polar(torch.ones_like(angles), angles)


def apply_rotary_emb(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    """``x``: ``(batch, seq, heads, head_dim)``; adjacent pairs rotated (TorchTitan's layout)."""
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    out = torch.view_as_real(xc * freqs_cis[: x.shape[1]].view(1, x.shape[1], 1, -1)).flatten(3)
    return out.type_as(x)


# --------------------------------------------------------------- attention
class InnerAttention(nn.Module):
    """Rotary embedding and the attention kernel on plain (under TP: local) heads.

    ``q``: ``(batch, seq, heads, head_dim)``, ``k``/``v``: ``(batch, seq, kv_heads,
    head_dim)``; returns ``(batch, seq, heads, head_dim)``. ``mask``: None (causal), a
    boolean SDPA mask or a flex ``BlockMask``. With None the backend decides: flex
    attention with a causal ``BlockMask`` (built once per length and device) or SDPA's
    ``is_causal``.
    """

    def __init__(self, backend: AttentionBackend):
        super().__init__()
        self.backend = backend
        self._causal: dict[tuple[int, str], BlockMask] = {}

    def forward(self, q, k, v, freqs_cis: torch.Tensor, mask: AttentionMaskT, cache=None) -> torch.Tensor:
        q, k = apply_rotary_emb(q, freqs_cis), apply_rotary_emb(k, freqs_cis)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        gqa = q.shape[1] != k.shape[1]
        if cache is not None:  # decoding: attend to the cached positions too
            k, v = cache.update(k, v)
            mask = cache.attention_mask(q.shape[2], q.device)
        elif mask is None and use_flex(self.backend, q.device):
            mask = self._causal_block_mask(q.shape[2], q.device)
        return attend(q, k, v, mask, enable_gqa=gqa).transpose(1, 2)

    def _causal_block_mask(self, seqlen: int, device: torch.device) -> BlockMask:
        key = (seqlen, str(device))
        if key not in self._causal:
            self._causal[key] = create_block_mask(lambda b, h, q, kv: q >= kv, 1, None, seqlen, seqlen, device=device)
        return self._causal[key]


class Attention(nn.Module):
    def __init__(self, c: Llama3Config):
        super().__init__()
        self.head_dim = hd = c.head_size
        bias = c.attention_bias
        self.wq = nn.Linear(c.dim, c.n_heads * hd, bias=bias)
        self.wk = nn.Linear(c.dim, c.kv_heads * hd, bias=bias)
        self.wv = nn.Linear(c.dim, c.kv_heads * hd, bias=bias)
        self.wo = nn.Linear(c.n_heads * hd, c.dim, bias=bias)
        self.inner_attention = InnerAttention(c.attn_backend)
        self.compute_dtype: torch.dtype | None = None

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor, mask: AttentionMaskT, cache=None) -> torch.Tensor:
        bs, seq, _ = x.shape
        dt = self.compute_dtype
        # -1 heads: under TP the projections are sharded and infer their local count.
        q = linear(x, self.wq, dt).view(bs, seq, -1, self.head_dim)
        k = linear(x, self.wk, dt).view(bs, seq, -1, self.head_dim)
        v = linear(x, self.wv, dt).view(bs, seq, -1, self.head_dim)
        out = self.inner_attention(q, k, v, freqs_cis, mask, **({} if cache is None else {"cache": cache}))
        return linear(out.reshape(bs, seq, -1), self.wo, dt)

    def init_weights(self, init_std: float) -> None:
        for lin in (self.wq, self.wk, self.wv):
            trunc_normal_(lin.weight, mean=0.0, std=0.02)
        trunc_normal_(self.wo.weight, mean=0.0, std=init_std)
        for lin in (self.wq, self.wk, self.wv, self.wo):
            if lin.bias is not None:  # TorchTitan's Llama 3 has none; Hugging Face's start at zero
                nn.init.zeros_(lin.bias)


# ------------------------------------------------------------------- blocks
class TransformerBlock(nn.Module):
    moe_enabled = False  # for the shared init_block_

    def __init__(self, layer_id: int, c: Llama3Config):
        super().__init__()
        self.attention = Attention(c)
        self.feed_forward = FeedForward(c.dim, c.ffn_hidden_dim)
        self.attention_norm = nn.RMSNorm(c.dim, eps=c.norm_eps)
        self.ffn_norm = nn.RMSNorm(c.dim, eps=c.norm_eps)
        self.weight_init_std = depth_scaled_std(layer_id, c.n_layers, c.depth_init)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor, mask: AttentionMaskT, cache=None) -> torch.Tensor:
        # cache only as a keyword, and only when decoding: a TP plan's input layouts cover the training call
        h = x + self.attention(self.attention_norm(x), freqs_cis, mask, **({} if cache is None else {"cache": cache}))
        return h + self.feed_forward(self.ffn_norm(h))

    def init_weights(self, buffer_device: torch.device | None) -> None:
        init_block_(self, buffer_device)


# -------------------------------------------------------------------- model
class Llama3Model(ComputeDtypeMixin, nn.Module):
    """``forward(tokens)``: ids ``(batch, seq)`` on the first pipeline stage, hidden
    states ``(batch, seq, dim)`` on later ones; logits ``(batch, seq, vocab)`` on the
    last stage, else hidden states. ``tok_embeddings``/``norm``/``output`` may be None."""

    def __init__(self, config: Llama3Config):
        super().__init__()
        config.check()
        self.config = c = config
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(c.vocab_size, c.dim)
        # Non-persistent: never in state_dict(), rebuilt by init_weights; a plain tensor
        # even under TP (it reaches inner_attention, where the heads are local).
        self.register_buffer("freqs_cis", self._precompute_freqs_cis(), persistent=False)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(i, c) for i in range(c.n_layers)})
        self.norm: nn.RMSNorm | None = nn.RMSNorm(c.dim, eps=c.norm_eps)
        self.output: nn.Linear | None = nn.Linear(c.dim, c.vocab_size, bias=False)
        if c.enable_weight_tying:
            self.output.weight = self.tok_embeddings.weight
        self.compute_dtype: torch.dtype | None = None

    def _precompute_freqs_cis(self) -> torch.Tensor:
        c = self.config
        return precompute_freqs_cis(c.head_size, c.max_seq_len, c.rope_theta, c.rope_scaling)

    # ------------------------------------------------------------------ init
    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        """TorchTitan's scheme and order: embeddings N(0, 1), projections truncated normal
        with depth-scaled std, output truncated normal with std dim**-0.5 cut at 3 sigma
        (tied: the output init overwrites the shared embedding); rebuilds ``freqs_cis``."""
        c = self.config
        buffer_device = buffer_device or self.freqs_cis.device
        with torch.device(buffer_device):
            self.freqs_cis = self._precompute_freqs_cis()
        # Re-tie (to_empty gives each module its own tensor).
        if c.enable_weight_tying and self.tok_embeddings is not None and self.output is not None:
            self.output.weight = self.tok_embeddings.weight
        init_decoder_(self, buffer_device, self.output, c.dim)

    # ---------------------------------------------------------------- masks
    def stage_inputs(self, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
        """What every pipeline stage needs from the token ids (``PipelineInfo.stage_inputs``):
        the document ids of a ``block_causal`` mask; nothing for causal attention."""
        if self.config.attn_mask is AttentionMask.causal:
            return {}
        return {"doc_ids": document_ids(tokens, self.config.eos_id)}

    def attention_mask(self, doc_ids: torch.Tensor | None) -> AttentionMaskT:
        """None for causal attention (the kernel handles it); for ``block_causal``, a
        flex ``BlockMask`` or a boolean SDPA mask from the document ids."""
        c = self.config
        if c.attn_mask is AttentionMask.causal:
            return None
        if doc_ids is None:
            raise ValueError(
                "model.attn_mask=block_causal: a later pipeline stage needs doc_ids "
                "(the trainer passes stage_inputs)"
            )
        build_mask = block_mask if use_flex(c.attn_backend, doc_ids.device) else dense_mask
        return build_mask(doc_ids, doc_ids.shape[1], None, doc_ids.device)

    # -------------------------------------------------------------- forward
    def forward(self, tokens: torch.Tensor, doc_ids: torch.Tensor | None = None, cache=None) -> torch.Tensor:
        """Token ids (first stage) or hidden states; ``doc_ids`` only on later pipeline
        stages under ``block_causal`` (the first stage derives them from the ids).
        ``cache``: a ``titan_plugins.generate.KVCache`` (single stage, decoding only)."""
        if cache is not None:
            return self._decode(tokens, cache)
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
        mask = self.attention_mask(doc_ids)
        for layer in self.layers.values():
            if layer is not None:
                h = layer(h, self.freqs_cis, mask)
        if self.norm is not None:
            h = self.norm(h)
        if self.output is None:
            return h
        return linear(cast(h, self.compute_dtype), self.output, self.compute_dtype)

    def _decode(self, tokens: torch.Tensor, cache) -> torch.Tensor:
        """The new tokens at positions ``cache.pos..``, attending to the cache."""
        h = self.tok_embeddings(tokens)
        freqs_cis = self.freqs_cis[cache.pos :]
        for name, layer in self.layers.items():
            h = layer(h, freqs_cis, None, cache.layer(name))
        h = self.norm(h)
        return linear(cast(h, self.compute_dtype), self.output, self.compute_dtype)


def build(config: Llama3Config) -> Llama3Model:
    """The contract's builder (works under ``torch.device("meta")``)."""
    return Llama3Model(config)
