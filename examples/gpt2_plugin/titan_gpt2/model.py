"""A GPT-2 style decoder: learned token and position embeddings, pre-LayerNorm
blocks of causal multi-head attention and a GELU MLP, a final LayerNorm and an
(untied) output projection.

Pipeline-aware: ``tok_embeddings`` and ``pos_embeddings`` exist only on the first
stage, ``norm`` and ``output`` only on the last; later stages take hidden states.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from titan_gpt2.config import Activation, GPT2Config


class SDPA(nn.Module):
    """The attention kernel as a module so the TP plan can hand it local heads."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class Attention(nn.Module):
    def __init__(self, c: GPT2Config):
        super().__init__()
        self.head_dim = c.head_dim
        # Separate q/k/v (GPT-2's fused c_attn would interleave badly under column-wise TP).
        self.wq = nn.Linear(c.dim, c.dim)
        self.wk = nn.Linear(c.dim, c.dim)
        self.wv = nn.Linear(c.dim, c.dim)
        self.wo = nn.Linear(c.dim, c.dim)
        self.inner_attention = SDPA()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bs, seqlen, _ = x.shape
        q, k, v = (w(x).view(bs, seqlen, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        out = self.inner_attention(q, k, v)
        return self.wo(out.transpose(1, 2).contiguous().view(bs, seqlen, -1))


class MLP(nn.Module):
    def __init__(self, c: GPT2Config):
        super().__init__()
        self.fc = nn.Linear(c.dim, c.mlp_ratio * c.dim)
        self.proj = nn.Linear(c.mlp_ratio * c.dim, c.dim)
        self.approximate = "tanh" if c.activation is Activation.gelu_tanh else "none"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x), approximate=self.approximate))


class Block(nn.Module):
    def __init__(self, c: GPT2Config):
        super().__init__()
        self.attention_norm = nn.LayerNorm(c.dim, eps=c.norm_eps)
        self.attention = Attention(c)
        self.ffn_norm = nn.LayerNorm(c.dim, eps=c.norm_eps)
        self.feed_forward = MLP(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class GPT2(nn.Module):
    def __init__(self, config: GPT2Config):
        super().__init__()
        self.config = c = config
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(c.vocab_size, c.dim)
        self.pos_embeddings: nn.Embedding | None = nn.Embedding(c.max_seq_len, c.dim)
        self.layers = nn.ModuleDict({str(i): Block(c) for i in range(c.n_layers)})
        self.norm: nn.LayerNorm | None = nn.LayerNorm(c.dim, eps=c.norm_eps)
        self.output: nn.Linear | None = nn.Linear(c.dim, c.vocab_size, bias=False)

    @torch.no_grad()
    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        """GPT-2's scheme: N(0, 0.02) weights, zero biases, residual projections
        scaled by 1/sqrt(2 * n_layers). No buffers to rebuild."""
        residual_std = 0.02 / (2 * self.config.n_layers) ** 0.5
        for embedding in (self.tok_embeddings, self.pos_embeddings):
            if embedding is not None:
                nn.init.normal_(embedding.weight, std=0.02)
        for block in self.layers.values():
            for name, module in block.named_modules():
                if isinstance(module, nn.Linear):
                    std = residual_std if name.endswith(("wo", "proj")) else 0.02
                    nn.init.normal_(module.weight, std=std)
                    nn.init.zeros_(module.bias)
                elif isinstance(module, nn.LayerNorm):
                    module.reset_parameters()
        if self.norm is not None:
            self.norm.reset_parameters()
        if self.output is not None:
            nn.init.normal_(self.output.weight, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.tok_embeddings is not None:
            positions = torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0)  # [1, S]
            h = self.tok_embeddings(tokens) + self.pos_embeddings(positions)
        else:
            h = tokens  # hidden states from the previous pipeline stage
        for block in self.layers.values():
            h = block(h)
        if self.norm is not None:
            h = self.norm(h)
        return self.output(h) if self.output is not None else h


def build(config: GPT2Config) -> GPT2:
    return GPT2(config)
