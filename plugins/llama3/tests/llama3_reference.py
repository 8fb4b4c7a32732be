"""TorchTitan 0.2.2's Llama 3 built as its trainer builds it (meta build ->
``update_from_config(seq_len)`` -> ``to_empty`` -> seeded ``init_weights``), and ours
the same way. Its SDPA wrapper is set to the math kernel (ours runs under
``sdpa_kernel(MATH)`` too), so both sides compute with one kernel."""

from __future__ import annotations

from titan_llama3.config import Llama3Config
from titan_llama3.model import build
from torch import nn

from titan_plugins.testing.model_parts import seeded_build, torchtitan_reference
from titan_plugins.testing.torchtitan_ref import import_torchtitan


def reference_args(config: Llama3Config):
    """TorchTitan's ``TransformerModelArgs`` with the same numbers as ``config``."""
    args = import_torchtitan("torchtitan.models.llama3.model.args")
    s = config.rope_scaling
    return args.TransformerModelArgs(
        dim=config.dim, n_layers=config.n_layers, n_heads=config.n_heads, n_kv_heads=config.n_kv_heads,
        vocab_size=config.vocab_size, multiple_of=config.multiple_of,
        ffn_dim_multiplier=config.ffn_dim_multiplier, norm_eps=config.norm_eps, rope_theta=config.rope_theta,
        rope_scaling_args=args.RoPEScalingArgs(
            scaling_factor=s.scaling_factor, low_freq_factor=s.low_freq_factor,
            high_freq_factor=s.high_freq_factor, original_max_position_embeddings=s.original_max_position_embeddings,
        ),
        max_seq_len=config.max_seq_len, depth_init=config.depth_init,
    )


def build_reference(config: Llama3Config, seq_len: int, seed: int) -> nn.Module:
    mm = import_torchtitan("torchtitan.models.llama3.model.model")
    return torchtitan_reference(mm.Transformer, reference_args(config), seq_len, seed)


def build_ours(config: Llama3Config, seed: int) -> nn.Module:
    return seeded_build(build, config, seed)
