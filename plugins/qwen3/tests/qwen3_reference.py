"""TorchTitan 0.2.2's Qwen3 built as its trainer builds it, made to run on CPU.

Deviations from a plain import, all outside the math under test:

* ``torch.histc`` (TorchTitan's router counts tokens per expert with it) has no int64
  CPU kernel: ``cpu_histc`` counts in float32 and hands back the input's dtype
  (exact for counts < 2**24). Tests install it with monkeypatch.
* Its SDPA wrapper's kernel list is set to the math kernel (ours runs under
  ``sdpa_kernel(MATH)`` too): Qwen3-MoE's 8th/9th expert scores can differ by ~1e-6
  between kernels, enough to flip a top-8 choice.
"""

from __future__ import annotations

import dataclasses

from titan_qwen3.config import Qwen3Config
from titan_qwen3.model import build
from torch import nn

from titan_plugins.testing.model_parts import cpu_histc, seeded_build, torchtitan_reference  # noqa: F401 (re-exported)
from titan_plugins.testing.torchtitan_ref import import_torchtitan


def reference_args(config: Qwen3Config):
    """TorchTitan's ``Qwen3ModelArgs`` with the same numbers as ``config``."""
    tt = import_torchtitan("torchtitan.models.qwen3")
    moe = import_torchtitan("torchtitan.models.moe")
    m = config.moe
    return tt.Qwen3ModelArgs(
        dim=config.dim, n_layers=config.n_layers, n_heads=config.n_heads,
        n_kv_heads=config.n_kv_heads, vocab_size=config.vocab_size, head_dim=config.head_dim,
        hidden_dim=config.hidden_dim, norm_eps=config.norm_eps, rope_theta=config.rope_theta,
        qk_norm=config.qk_norm, max_seq_len=config.max_seq_len, depth_init=config.depth_init,
        enable_weight_tying=config.enable_weight_tying, moe_enabled=config.moe_enabled,
        moe_inter_dim=config.moe_inter_dim,
        moe_args=moe.MoEArgs(
            num_experts=m.num_experts, num_shared_experts=m.num_shared_experts,
            score_func=m.score_func.value, route_norm=m.route_norm, route_scale=m.route_scale,
            score_before_experts=m.score_before_experts, top_k=m.top_k,
            num_expert_groups=m.num_expert_groups, num_limited_groups=m.num_limited_groups,
            # its grouped-mm path pads groups with a triton kernel; the loop is the same math
            use_grouped_mm=False, load_balance_coeff=m.load_balance_coeff,
        ),
    )


def build_reference(config: Qwen3Config, seq_len: int, seed: int) -> nn.Module:
    """Meta build -> ``update_from_config(seq_len)`` -> ``to_empty`` -> seeded
    ``init_weights``, as TorchTitan's trainer does."""
    mm = import_torchtitan("torchtitan.models.qwen3.model.model")
    return torchtitan_reference(mm.Qwen3Model, reference_args(config), seq_len, seed)


def build_ours(config: Qwen3Config, seed: int) -> nn.Module:
    return seeded_build(build, config, seed)


def small(config: Qwen3Config, **overrides) -> Qwen3Config:
    return dataclasses.replace(config, **overrides)
