"""DeepSeek-V3: Multi-head Latent Attention, YaRN rotary embeddings, RMSNorm, dense
SwiGLU in the first ``n_dense_layers`` blocks and MoE (shared experts, aux-loss-free
balancing) in the rest. TorchTitan 0.2.2's definition: same parameter layout, order
of operations and initialisation, so its checkpoints load through the state-dict
adapter and give the same logits. The output projection is ``lm_head`` (TorchTitan:
``output``; the adapter maps the names).

Parallelism is applied from outside (``titan_deepseek_v3.parallelize``); the forward
only has to tolerate the modules a pipeline stage does not own being ``None``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from titan_deepseek_v3.config import DeepSeekV3Config
from titan_plugins.components.attention import attend
from titan_plugins.components.compute_dtype import ComputeDtypeMixin, cast
from titan_plugins.components.cp_attention import rope_rows
from titan_plugins.components.feed_forward import FeedForward
from titan_plugins.components.init import (
    depth_scaled_std,
    init_block_,
    init_decoder_,
    trunc_normal_,
)
from titan_plugins.components.moe import MoE
from titan_plugins.components.rope import apply_rotary_emb, yarn_freqs_cis


# ----------------------------------------------------------------- compute dtype
# Linear and RMSNorm that compute in ``compute_dtype`` (set by ``set_compute_dtype``)
# while their parameters keep their own dtype. The cast happens inside ``forward``, so
# every hook on the module (a TP plan's layouts, FSDP's unshard) still runs first and
# the state-dict names stay nn.Linear's / nn.RMSNorm's.
class Linear(nn.Linear):
    compute_dtype: torch.dtype | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dt = self.compute_dtype
        bias = None if self.bias is None else cast(self.bias, dt)
        return F.linear(cast(x, dt), cast(self.weight, dt), bias)


class RMSNorm(nn.RMSNorm):
    compute_dtype: torch.dtype | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dt = self.compute_dtype
        weight = None if self.weight is None else cast(self.weight, dt)
        return F.rms_norm(cast(x, dt), self.normalized_shape, weight, self.eps)


# ------------------------------------------------------------------------ YaRN rope
def precompute_freqs_cis(config: DeepSeekV3Config) -> torch.Tensor:
    """``(max_seq_len, qk_rope_head_dim // 2)`` complex64 rotations, YaRN-scaled when
    ``max_seq_len > rope.original_seq_len`` (DeepSeek-V3's reference code; the shared
    ``components.rope.yarn_freqs_cis``)."""
    rope = config.layer.rope
    return yarn_freqs_cis(
        config.layer.attention.qk_rope_head_dim, config.max_seq_len, rope.theta,
        enabled=config.yarn_enabled, factor=rope.factor, original_seq_len=rope.original_seq_len,
        beta_fast=rope.beta_fast, beta_slow=rope.beta_slow, attention_factor=rope.attention_factor,
    )


# ----------------------------------------------------------------------- attention
class SDPA(nn.Module):
    """The causal attention kernel, a module so a TP plan can hand it local tensors
    (SDPA on CPU has no DTensor sharding strategy). q, k, v: ``(bsz, heads, seq, d)``."""

    def __init__(self, scale: float):
        super().__init__()
        self.scale = scale

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        return attend(q, k, v, mask, scale=self.scale)  # None: causal (no flex backend for MLA here)


class Attention(nn.Module):
    """Multi-head Latent Attention.

    q: ``wq(x)``, or low-rank ``wq_b(q_norm(wq_a(x)))`` when ``q_lora_rank > 0``.
    kv: ``wkv_a(x)`` gives the compressed kv (``kv_lora_rank``) and one rotary key
    ``k_pe`` shared by all heads; ``wkv_b(kv_norm(kv))`` expands the latent into
    per-head ``k_nope`` and ``v``. Heads use ``qk_nope + qk_rope`` dims for q·k and
    ``v_head_dim`` for values.
    """

    def __init__(self, config: DeepSeekV3Config):
        super().__init__()
        att, dim, eps = config.layer.attention, config.dim, config.layer.norm.latent
        self.q_lora_rank = att.q_lora_rank
        self.kv_lora_rank = att.kv_lora_rank
        self.qk_nope_head_dim = att.qk_nope_head_dim
        self.qk_rope_head_dim = att.qk_rope_head_dim
        self.qk_head_dim = att.qk_head_dim
        self.v_head_dim = att.v_head_dim
        if self.q_lora_rank == 0:
            self.wq = Linear(dim, att.n_heads * att.qk_head_dim, bias=False)
        else:
            self.wq_a = Linear(dim, att.q_lora_rank, bias=False)
            self.q_norm = RMSNorm(att.q_lora_rank, eps=eps)
            self.wq_b = Linear(att.q_lora_rank, att.n_heads * att.qk_head_dim, bias=False)
        self.wkv_a = Linear(dim, att.kv_lora_rank + att.qk_rope_head_dim, bias=False)
        self.kv_norm = RMSNorm(att.kv_lora_rank, eps=eps)
        self.wkv_b = Linear(
            att.kv_lora_rank, att.n_heads * (att.qk_nope_head_dim + att.v_head_dim), bias=False
        )
        self.wo = Linear(att.n_heads * att.v_head_dim, dim, bias=False)
        self.inner_attention = SDPA(config.softmax_scale)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor, cache=None) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        if self.q_lora_rank == 0:
            q = self.wq(x)
        else:
            q = self.wq_b(self.q_norm(self.wq_a(x)))
        # -1 heads: under tensor parallelism these are the local (or DTensor) heads.
        q = q.view(bsz, seqlen, -1, self.qk_head_dim)
        q_nope, q_pe = torch.split(q, [self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        q = torch.cat([q_nope, apply_rotary_emb(q_pe, freqs_cis)], dim=-1)

        kv = self.wkv_a(x)
        kv, k_pe = torch.split(kv, [self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        k_pe = apply_rotary_emb(k_pe.unsqueeze(2), freqs_cis)  # (bsz, seqlen, 1, rope)
        kv = self.wkv_b(self.kv_norm(kv))
        kv = kv.view(bsz, seqlen, -1, self.qk_nope_head_dim + self.v_head_dim)
        k_nope, v = torch.split(kv, [self.qk_nope_head_dim, self.v_head_dim], dim=-1)
        k = torch.cat([k_nope, k_pe.expand(-1, -1, k_nope.shape[2], -1)], dim=-1)

        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if cache is None:
            out = self.inner_attention(q, k, v)
        else:  # decoding: cache the expanded per-head k and v (each new token costs one position)
            k, v = cache.update(k, v)
            out = self.inner_attention(q, k, v, cache.attention_mask(seqlen, q.device))
        out = out.transpose(1, 2).reshape(bsz, seqlen, -1)
        return self.wo(out)

    def init_weights(self, init_std: float) -> None:
        # TorchTitan's order (it matters for seeded equality): wkv_a, wkv_b, q, then wo.
        q = [self.wq] if self.q_lora_rank == 0 else [self.wq_a, self.wq_b]
        for linear in (self.wkv_a, self.wkv_b, *q):
            trunc_normal_(linear.weight, mean=0.0, std=0.02)
        trunc_normal_(self.wo.weight, mean=0.0, std=init_std)
        self.kv_norm.reset_parameters()
        if self.q_lora_rank > 0:
            self.q_norm.reset_parameters()


# ---------------------------------------------------------------------------- block
class TransformerBlock(nn.Module):
    def __init__(self, layer_id: int, config: DeepSeekV3Config):
        super().__init__()
        dim, layer = config.dim, config.layer
        self.attention_norm = RMSNorm(dim, eps=layer.norm.eps)
        self.attention = Attention(config)
        self.ffn_norm = RMSNorm(dim, eps=layer.norm.eps)
        self.moe_enabled = config.is_moe_layer(layer_id)
        if self.moe_enabled:
            self.moe = MoE(layer.moe, dim, layer.moe.hidden_dim)
        else:
            self.feed_forward = FeedForward(dim, layer.ffn.hidden_dim)
        # Deeper blocks start smaller (TorchTitan's depth-scaled init, always by layer here).
        self.weight_init_std = depth_scaled_std(layer_id, config.n_layers)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor, cache=None) -> torch.Tensor:
        # cache only as a keyword, and only when decoding: a TP plan's input layouts cover the training call
        x = x + self.attention(self.attention_norm(x), freqs_cis, **({} if cache is None else {"cache": cache}))
        ffn = self.moe if self.moe_enabled else self.feed_forward
        return x + ffn(self.ffn_norm(x))

    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        init_block_(self, buffer_device)


# ---------------------------------------------------------------------------- model
class DeepSeekV3Model(ComputeDtypeMixin, nn.Module):
    """``forward(tokens)``: token ids on the first pipeline stage, hidden states after;
    logits ``(bsz, seq, vocab)`` on the last stage, hidden states elsewhere."""

    def __init__(self, config: DeepSeekV3Config):
        super().__init__()
        config.validate()
        self.config = config
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(config.vocab_size, config.dim)
        # Non-persistent: never in state_dict(); rebuilt by init_weights after to_empty.
        self.register_buffer("freqs_cis", precompute_freqs_cis(config), persistent=False)
        self.layers = nn.ModuleDict(
            {str(i): TransformerBlock(i, config) for i in range(config.n_layers)}
        )
        # TorchTitan's final norm has no explicit eps (final_eps None: torch.finfo(dtype).eps).
        self.norm: nn.RMSNorm | None = RMSNorm(config.dim, eps=config.layer.norm.final_eps)
        self.lm_head: nn.Linear | None = Linear(config.dim, config.vocab_size, bias=False)
        self.compute_dtype: torch.dtype | None = None

    @property
    def output(self) -> nn.Linear | None:
        """TorchTitan's name for ``lm_head`` (read-only), for helpers that look it up."""
        return self.lm_head

    def forward(self, tokens: torch.Tensor, cache=None) -> torch.Tensor:
        """``cache``: a ``titan_plugins.generate.KVCache`` (single stage, decoding only)."""
        dt = self.compute_dtype
        h = cast(self.tok_embeddings(tokens), dt) if self.tok_embeddings is not None else cast(tokens, dt)
        # context parallel: rope_rows gives the rows of this rank's global positions
        freqs_cis = rope_rows(self.freqs_cis) if cache is None else self.freqs_cis[cache.pos :]
        for name, layer in self.layers.items():
            h = layer(h, freqs_cis) if cache is None else layer(h, freqs_cis, cache.layer(name))
        if self.norm is not None:
            h = self.norm(h)
        if self.lm_head is not None:
            h = self.lm_head(h)
        return h

    @torch.no_grad()
    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        """TorchTitan's scheme: embeddings N(0, 1); attention and w1 projections
        trunc-normal(0.02); wo, w2, w3, gate and experts trunc-normal(0.02 / sqrt(2 (i+1)));
        lm_head trunc-normal(dim**-0.5, cut at 3 sigma); norms ones. Rebuilds
        ``freqs_cis`` on ``buffer_device`` (default: where it is now)."""
        buffer_device = buffer_device or self.freqs_cis.device
        with torch.device(buffer_device):
            self.freqs_cis = precompute_freqs_cis(self.config)
        init_decoder_(self, buffer_device, self.lm_head, self.config.dim)


def build(config: DeepSeekV3Config) -> DeepSeekV3Model:
    """The ModelSpec builder; works under ``torch.device("meta")``."""
    return DeepSeekV3Model(config)
