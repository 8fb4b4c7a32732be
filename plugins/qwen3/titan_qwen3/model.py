"""Qwen3: GQA attention with per-head q/k RMSNorm, rotary embeddings, SwiGLU or MoE.

Same architecture, parameter names and initialisation as TorchTitan v0.2.2's
``torchtitan/models/qwen3`` (a TorchTitan checkpoint loads as is). Tensor-parallel
surgery lives in ``parallelize.py``; this file only keeps the shapes DTensor-friendly
(``view(..., -1, head_dim)`` so sharded heads infer their local count).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.attention.flex_attention import BlockMask, create_block_mask

from titan_plugins.components.attention import AttentionBackend, attend, use_flex
from titan_plugins.components.attention_masks import block_mask, dense_mask, document_ids
from titan_plugins.components.compute_dtype import ComputeDtypeMixin, linear
from titan_plugins.components.feed_forward import FeedForward
from titan_plugins.components.init import (
    depth_scaled_std,
    init_block_,
    init_decoder_,
    trunc_normal_,
)
from titan_plugins.components.moe import MoE
from titan_qwen3.config import AttentionMask, Qwen3Config

AttentionMaskT = torch.Tensor | BlockMask | None


# ----------------------------------------------------------------- rotary
def rope_cache(head_dim: int, max_seq_len: int, theta: float, device=None) -> torch.Tensor:
    """``[max_seq_len, 2 * head_dim]``: cos then sin of the rotation angles, each
    repeated over both halves of the head (the rotate-half convention)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device)[: head_dim // 2].float() / head_dim))
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float32, device=device), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return torch.cat([angles.cos(), angles.sin()], dim=-1)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(xq: torch.Tensor, xk: torch.Tensor, cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate ``[batch, seq, heads, head_dim]`` queries and keys by position."""
    _, seqlen, _, head_dim = xq.shape
    if seqlen > cache.shape[0]:
        raise ValueError(
            f"sequence length {seqlen} exceeds the rotary cache (model.max_seq_len={cache.shape[0]})"
        )
    cache = cache[:seqlen].view(1, seqlen, 1, 2 * head_dim)
    cos = cache[..., :head_dim].to(xq.dtype)
    sin = cache[..., head_dim:].to(xq.dtype)
    xq_out = xq * cos + _rotate_half(xq) * sin
    xk_out = xk * cos + _rotate_half(xk) * sin
    return xq_out.type_as(xq), xk_out.type_as(xk)


# ---------------------------------------------------------------- attention
class AttentionKernel(nn.Module):
    """The attention kernel on ``[B, H, S, D]`` (plain local tensors under TP).

    ``mask``: None for causal attention, a boolean ``[B, 1, S, S]`` mask (SDPA,
    True = attend) or a flex ``BlockMask``. With None the backend decides: flex
    attention (causal ``BlockMask`` built once per length and device) or SDPA's
    ``is_causal``. Flex is compiled on GPU and eager on CPU, where torch has no
    backward for it.
    """

    def __init__(self, backend: AttentionBackend, scale: float, enable_gqa: bool):
        super().__init__()
        self.backend, self.scale, self.enable_gqa = backend, scale, enable_gqa
        self._causal: dict[tuple[int, str], BlockMask] = {}

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMaskT) -> torch.Tensor:
        if mask is None and use_flex(self.backend, q.device):
            mask = self._causal_block_mask(q.shape[2], q.device)
        return attend(q, k, v, mask, scale=self.scale, enable_gqa=self.enable_gqa)

    def _causal_block_mask(self, seqlen: int, device: torch.device) -> BlockMask:
        key = (seqlen, str(device))
        if key not in self._causal:
            self._causal[key] = create_block_mask(
                lambda b, h, q, kv: q >= kv, 1, None, seqlen, seqlen, device=device
            )
        return self._causal[key]


class Attention(nn.Module):
    def __init__(self, c: Qwen3Config):
        super().__init__()
        self.head_dim = c.head_dim
        self.wq = nn.Linear(c.dim, c.n_heads * c.head_dim, bias=False)
        self.wk = nn.Linear(c.dim, c.n_kv_heads * c.head_dim, bias=False)
        self.wv = nn.Linear(c.dim, c.n_kv_heads * c.head_dim, bias=False)
        self.wo = nn.Linear(c.n_heads * c.head_dim, c.dim, bias=False)
        self.q_norm = nn.RMSNorm(c.head_dim, eps=c.norm_eps) if c.qk_norm else None
        self.k_norm = nn.RMSNorm(c.head_dim, eps=c.norm_eps) if c.qk_norm else None
        self.inner_attention = AttentionKernel(c.attn_backend, c.head_dim**-0.5, c.n_heads > c.n_kv_heads)
        self.compute_dtype: torch.dtype | None = None

    def forward(self, x: torch.Tensor, rope: torch.Tensor, mask: AttentionMaskT, cache=None) -> torch.Tensor:
        bs, seqlen, _ = x.shape
        dtype = self.compute_dtype
        # -1 heads: under TP the projections are sharded and infer their local count.
        xq = linear(x, self.wq, dtype).view(bs, seqlen, -1, self.head_dim)
        xk = linear(x, self.wk, dtype).view(bs, seqlen, -1, self.head_dim)
        xv = linear(x, self.wv, dtype).view(bs, seqlen, -1, self.head_dim)
        if self.q_norm is not None:
            xq, xk = self.q_norm(xq), self.k_norm(xk)
        xq, xk = apply_rotary(xq, xk, rope)
        xq, xk, xv = xq.transpose(1, 2), xk.transpose(1, 2), xv.transpose(1, 2)
        if cache is not None:  # decoding: attend to the cached positions too
            xk, xv = cache.update(xk, xv)
        out = self.inner_attention(xq, xk, xv, mask)
        out = out.transpose(1, 2).contiguous().view(bs, seqlen, -1)
        return linear(out, self.wo, dtype)

    def init_weights(self, init_std: float) -> None:
        for lin in (self.wq, self.wk, self.wv):
            trunc_normal_(lin.weight, mean=0.0, std=0.02)
        trunc_normal_(self.wo.weight, mean=0.0, std=init_std)
        for norm in (self.q_norm, self.k_norm):
            if norm is not None:
                norm.reset_parameters()


# -------------------------------------------------------------------- blocks
class TransformerBlock(nn.Module):
    def __init__(self, layer_id: int, c: Qwen3Config):
        super().__init__()
        self.attention = Attention(c)
        self.moe_enabled = c.moe_enabled
        if c.moe_enabled:
            self.moe = MoE(c.moe, dim=c.dim, hidden_dim=c.moe_inter_dim)
        else:
            self.feed_forward = FeedForward(c.dim, c.hidden_dim)
        self.attention_norm = nn.RMSNorm(c.dim, eps=c.norm_eps)
        self.ffn_norm = nn.RMSNorm(c.dim, eps=c.norm_eps)
        self.weight_init_std = depth_scaled_std(layer_id, c.n_layers, c.depth_init)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, mask: AttentionMaskT, cache=None) -> torch.Tensor:
        # cache only as a keyword, and only when decoding: a TP plan's input layouts cover the training call
        x = x + self.attention(self.attention_norm(x), rope, mask, **({} if cache is None else {"cache": cache}))
        mlp = self.moe if self.moe_enabled else self.feed_forward
        return x + mlp(self.ffn_norm(x))

    def init_weights(self, buffer_device: torch.device | None) -> None:
        init_block_(self, buffer_device)


# --------------------------------------------------------------------- model
class Qwen3Model(ComputeDtypeMixin, nn.Module):
    """``forward(tokens)``: ids ``[B, S]`` on the first pipeline stage, hidden states
    ``[B, S, D]`` on later ones; logits ``[B, S, V]`` on the last stage."""

    def __init__(self, config: Qwen3Config):
        super().__init__()
        config.check()
        self.config = config
        c = config
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(c.vocab_size, c.dim)
        # Non-persistent: never in state_dict(), rebuilt by init_weights; a plain
        # tensor even under TP (the TP plan makes it a replicated DTensor per call).
        self.register_buffer("rope_cache", rope_cache(c.head_dim, c.max_seq_len, c.rope_theta), persistent=False)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(i, c) for i in range(c.n_layers)})
        self.norm: nn.RMSNorm | None = nn.RMSNorm(c.dim, eps=c.norm_eps)
        self.output: nn.Linear | None = nn.Linear(c.dim, c.vocab_size, bias=False)
        if c.enable_weight_tying:
            self.output.weight = self.tok_embeddings.weight
        self.compute_dtype: torch.dtype | None = None

    # ------------------------------------------------------------------ init
    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        """TorchTitan's scheme: embeddings N(0, 1), projections truncated normal with
        depth-scaled std, output truncated normal with std dim**-0.5 cut at 3 sigma
        (tied: the output init overwrites the shared embedding)."""
        c = self.config
        buffer_device = buffer_device or self.rope_cache.device
        self.rope_cache = rope_cache(c.head_dim, c.max_seq_len, c.rope_theta, device=buffer_device)
        # Re-tie (to_empty gives each module its own tensor); the output init then
        # overwrites the shared weight, drawing the same numbers as tying after the norm.
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
        # The sequence length is the ids': a later stage's hidden states may be a
        # sequence shard (TP with sequence parallelism).
        build = block_mask if use_flex(c.attn_backend, doc_ids.device) else dense_mask
        return build(doc_ids, doc_ids.shape[1], None, doc_ids.device)

    # -------------------------------------------------------------- forward
    def forward(self, tokens: torch.Tensor, doc_ids: torch.Tensor | None = None, cache=None) -> torch.Tensor:
        """Token ids (first stage) or hidden states; ``doc_ids`` only on later pipeline
        stages under ``block_causal`` (the first stage derives them from the ids).
        ``cache``: a ``titan_plugins.generate.KVCache`` (single stage, decoding only)."""
        if cache is not None:
            return self._decode(tokens, cache)
        if self.tok_embeddings is not None:
            if doc_ids is None:
                doc_ids = self.stage_inputs(tokens).get("doc_ids")
            h = self.tok_embeddings(tokens)
        else:
            h = tokens
        mask = self.attention_mask(doc_ids)
        for layer in self.layers.values():
            if layer is not None:
                h = layer(h, self.rope_cache, mask)
        if self.norm is not None:
            h = self.norm(h)
        if self.output is not None:
            if self.compute_dtype is not None:
                h = h.to(self.output.weight.dtype)
            h = self.output(h)
        return h


    def _decode(self, tokens: torch.Tensor, cache) -> torch.Tensor:
        """The new tokens at positions ``cache.pos..``, attending to the cache."""
        h = self.tok_embeddings(tokens)
        rope = self.rope_cache[cache.pos :]
        mask = cache.attention_mask(tokens.shape[1], tokens.device)
        for name, layer in self.layers.items():
            h = layer(h, rope, mask, cache.layer(name))
        h = self.norm(h)
        if self.compute_dtype is not None:
            h = h.to(self.output.weight.dtype)
        return self.output(h)


def build(config: Qwen3Config) -> Qwen3Model:
    """The contract's builder (works under ``torch.device("meta")``)."""
    return Qwen3Model(config)
