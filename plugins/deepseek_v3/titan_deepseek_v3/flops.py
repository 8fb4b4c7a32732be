"""Parameter and FLOP counts from the config alone (torch-free, exact).

The counts match a built model's ``named_parameters()`` (a test checks it on meta);
``active`` counts the routed experts by ``top_k / num_experts``, like TorchTitan.
"""

from __future__ import annotations

from dataclasses import dataclass

from titan_deepseek_v3.config import DeepSeekV3Config


@dataclass(frozen=True)
class ParamCounts:
    total: int
    active: int  # per token: dense + router + shared experts + top_k routed experts
    embedding: int
    routed_experts: int


def param_counts(config: DeepSeekV3Config) -> ParamCounts:
    dim, layer = config.dim, config.layer
    att, moe = layer.attention, layer.moe
    q = dim * att.n_heads * att.qk_head_dim if att.q_lora_rank == 0 else (
        dim * att.q_lora_rank + att.q_lora_rank + att.q_lora_rank * att.n_heads * att.qk_head_dim
    )
    attention = (
        q
        + dim * (att.kv_lora_rank + att.qk_rope_head_dim)  # wkv_a
        + att.kv_lora_rank  # kv_norm
        + att.kv_lora_rank * att.n_heads * (att.qk_nope_head_dim + att.v_head_dim)  # wkv_b
        + att.n_heads * att.v_head_dim * dim  # wo
    )
    norms = 2 * dim
    dense_ffn = 3 * dim * layer.ffn.hidden_dim
    routed = 3 * moe.num_experts * dim * moe.hidden_dim
    router = dim * moe.num_experts
    shared = 3 * dim * moe.hidden_dim * moe.num_shared_experts
    n_moe = config.n_layers - config.n_dense_layers
    embedding = config.vocab_size * dim
    dense = (
        embedding + dim + dim * config.vocab_size  # tok_embeddings, final norm, lm_head
        + config.n_layers * (attention + norms) + config.n_dense_layers * dense_ffn
    )
    total = dense + n_moe * (router + shared + routed)
    active = dense + n_moe * (router + shared + routed * moe.top_k // moe.num_experts)
    return ParamCounts(total=total, active=active, embedding=embedding, routed_experts=n_moe * routed)


def flops(config: DeepSeekV3Config, seq_len: int) -> tuple[int, int]:
    """``(num_params, flops_per_token)`` as TorchTitan counts them: 6 x active
    non-embedding parameters + 6 x layers x heads x (qk + v head dims) x seq_len."""
    counts = param_counts(config)
    att = config.layer.attention
    head_dims = att.qk_nope_head_dim + att.qk_rope_head_dim + att.v_head_dim
    per_token = 6 * (counts.active - counts.embedding) + 6 * config.n_layers * att.n_heads * head_dims * seq_len
    return counts.total, per_token
