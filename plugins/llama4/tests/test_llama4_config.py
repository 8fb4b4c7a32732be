"""Flavors, derived sizes, published parameter counts, plugin registration, Hydra
composition, validation and the state-dict adapter."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from titan_llama4.config import FLAVORS, AttentionMask, Llama4Config, flops, num_params, validate

from titan_plugins.config.schema import ParallelismConfig
from titan_plugins.errors import ConfigError
from titan_plugins.testing.model_parts import assert_imports_without_torch


def _meta(cfg: Llama4Config):
    from titan_llama4.model import build

    with torch.device("meta"):
        return build(cfg)


# ---------------------------------------------------------------- flavors
def test_debugmodel_shapes():
    cfg = FLAVORS["debugmodel"]
    assert (cfg.dim, cfg.n_layers, cfg.n_heads, cfg.kv_heads, cfg.vocab_size) == (
        256,
        6,
        16,
        16,
        2048,
    )
    assert [i for i in range(6) if cfg.is_moe_layer(i)] == [1, 3, 5]
    assert (cfg.moe.num_experts, cfg.moe.top_k, cfg.moe.num_shared_experts) == (8, 1, 1)
    assert cfg.moe.score_func.value == "sigmoid" and cfg.moe.score_before_experts
    # 4*256*2/3 = 682 -> /(top_k + shared) = 341 -> up to a multiple of 256
    assert cfg.moe_hidden_dim == 512 and cfg.ffn_hidden_dim == 768
    assert cfg.rope_theta == 5e5 and cfg.norm_eps == 1e-5
    rs = cfg.rope_scaling
    assert rs.enabled and (
        rs.scaling_factor,
        rs.low_freq_factor,
        rs.high_freq_factor,
        rs.original_max_position_embeddings,
    ) == (16, 1, 1, 8192)
    irope = FLAVORS["debugmodel_irope"]
    assert [irope.uses_rope(i) for i in range(6)] == [False, True, True, True, False, True]
    assert [irope.attn_chunk_size(i) for i in range(6)] == [None, 256, 256, 256, None, 256]


@pytest.mark.parametrize("flavor", sorted(FLAVORS))
def test_flavors_match_torchtitan(flavor):
    """Every field against TorchTitan 0.2.2's flavor, and the built shapes against
    its meta-built model (same parameter names and shapes)."""
    from titan_plugins.testing.torchtitan_ref import import_torchtitan

    try:
        tt = import_torchtitan("torchtitan.models.llama4")
    except ImportError as exc:
        pytest.skip(f"torchtitan not importable: {exc}")
    ref = tt.llama4_args[flavor]
    ours = FLAVORS[flavor]
    for key in (
        "dim",
        "n_layers",
        "n_heads",
        "n_kv_heads",
        "vocab_size",
        "multiple_of",
        "ffn_dim_multiplier",
        "norm_eps",
        "rope_theta",
        "depth_init",
        "every_n_layers_nope",
        "interleave_moe_layer_step",
        "auto_scale_hidden_dim",
    ):
        assert getattr(ours, key) == getattr(ref, key), key
    if ours.every_n_layers_nope is not None:
        assert ours.fixed_attn_block_size == ref.fixed_attn_block_size
    assert ours.attn_mask.value == ref.attn_mask_type  # irope flavors: block_causal
    if ref.rope_scaling_args is None:
        assert not ours.rope_scaling.enabled
    else:
        assert ours.rope_scaling.enabled
        for key in (
            "scaling_factor",
            "low_freq_factor",
            "high_freq_factor",
            "original_max_position_embeddings",
        ):
            assert getattr(ours.rope_scaling, key) == getattr(ref.rope_scaling_args, key)
    for key in (
        "num_experts",
        "num_shared_experts",
        "route_norm",
        "route_scale",
        "score_before_experts",
        "top_k",
        "num_expert_groups",
        "num_limited_groups",
        "load_balance_coeff",
    ):
        assert getattr(ours.moe, key) == getattr(ref.moe_args, key), key
    assert ours.moe.score_func.value == ref.moe_args.score_func

    mm = import_torchtitan("torchtitan.models.llama4.model.model")
    ref_args = dataclasses.replace(ref, n_layers=min(ref.n_layers, 4), max_seq_len=16)
    with torch.device("meta"):
        ref_model = mm.Transformer(ref_args)
    ours_model = _meta(dataclasses.replace(ours, n_layers=ref_args.n_layers, max_seq_len=16))
    assert {k: v.shape for k, v in ours_model.state_dict().items()} == {
        k: v.shape for k, v in ref_model.state_dict().items()
    }


# ----------------------------------------------------- published counts
def _counts(flavor):
    cfg = FLAVORS[flavor]
    model = _meta(cfg)
    built = sum(p.numel() for p in model.parameters())
    total, active = num_params(cfg)
    assert built == total  # the closed form agrees with the built module
    routed = sum(p.numel() for n, p in model.named_parameters() if ".moe.experts." in n)
    assert active == total - routed + routed * cfg.moe.top_k // cfg.moe.num_experts
    return total, active


def test_scout_parameter_counts():
    total, active = _counts("17bx16e")
    # Meta: Llama 4 Scout, 17B active / 109B total (the text decoder is ~107.8B of it).
    assert total == 107_769_861_120 and active == 17_172_894_720
    assert total == pytest.approx(109e9, rel=0.02) and active == pytest.approx(17e9, rel=0.02)


def test_maverick_parameter_counts():
    total, active = _counts("17bx128e")
    # Meta: Llama 4 Maverick, 17B active / 400B total.
    assert total == 400_711_848_960 and active == 17_184_691_200
    assert total == pytest.approx(400e9, rel=0.02) and active == pytest.approx(17e9, rel=0.02)


def test_flops_per_token():
    cfg = FLAVORS["debugmodel"]
    total, per_token = flops(cfg, seq_len=128)
    _, active = num_params(cfg)
    assert total == num_params(cfg)[0]
    assert per_token == 6 * (active - 2048 * 256) + 6 * 6 * 16 * 32 * 128


# -------------------------------------------------------------- plugin
def test_plugin_import_is_torch_free():
    assert_imports_without_torch("titan_llama4.plugin", "titan_llama4.config")


def test_registered_through_entry_point_and_hydra():
    from titan_plugins.config import hydra_glue
    from titan_plugins.plugins import get_plugin_manager

    pm = get_plugin_manager()
    assert "llama4" in pm.models()
    cfg = hydra_glue.compose(
        [
            "model=llama4",
            "model.flavor=debugmodel_irope",
            "model.n_layers=4",
            "model.rope_scaling.scaling_factor=8",
            "model.moe.top_k=2",
        ],
        pm,
    )
    spec, job = hydra_glue.resolve_job(cfg, pm)
    model_cfg = hydra_glue.model_config(job.model, spec)
    assert isinstance(model_cfg, Llama4Config)
    assert (model_cfg.n_layers, model_cfg.every_n_layers_nope, model_cfg.moe.top_k) == (4, 4, 2)
    assert model_cfg.rope_scaling.scaling_factor == 8.0 and model_cfg.dim == 256
    with pytest.raises(ConfigError, match="model.n_heads"):
        hydra_glue.compose(["model=llama4", "model.n_heads=many"], pm)


# ----------------------------------------------------------- validation
@pytest.mark.parametrize(
    "overrides, par, message",
    [
        ({}, dict(tp=3), "model.n_heads=16 is not divisible by parallelism.tp=3"),
        ({"n_kv_heads": 2}, dict(tp=4), "model.n_kv_heads=2 is not divisible by parallelism.tp=4"),
        (
            {},
            dict(ep=3, dp_shard=3),
            "model.moe.num_experts=8 is not divisible by parallelism.ep=3",
        ),
        ({"n_layers": 2}, dict(pp=4), "model.n_layers=2 is fewer than the 4 pipeline stages"),
        ({"n_layers": 1}, dict(ep=2, dp_shard=2), "no MoE layer"),
        ({"attn_mask": AttentionMask.block_causal, "eos_id": 2048}, dict(), "model.eos_id=2048 is outside"),
        ({"dim": 250}, dict(), "model.dim=250 is not divisible by model.n_heads=16"),
        (
            {"multiple_of": 100},
            dict(tp=8),
            "dense FFN hidden size 700 is not divisible by parallelism.tp=8",
        ),
        (
            {"multiple_of": 50},
            dict(tp=4),
            "expert hidden size 350 is not divisible by parallelism.tp=4",
        ),
        (
            {"multiple_of": 50},
            dict(tp=4, ep=2, etp=4, dp_shard=2),
            "350 is not divisible by parallelism.etp=4",
        ),
    ],
)
def test_validate_names_both_numbers(overrides, par, message):
    cfg = dataclasses.replace(FLAVORS["debugmodel"], **overrides)
    with pytest.raises(ConfigError, match=message):
        validate(cfg, ParallelismConfig(**par))


def test_validate_accepts_presets():
    cfg = FLAVORS["debugmodel"]
    for par in (
        dict(tp=2),
        dict(ep=2, dp_shard=2),
        dict(tp=2, ep=2, etp=2, dp_shard=2),
        dict(tp=2, pp=2),
        dict(tp=2, ep=4, dp_shard=2),
    ):
        validate(cfg, ParallelismConfig(**par))
    validate(FLAVORS["17bx16e"], ParallelismConfig(tp=8, ep=16, dp_shard=16, pp=4))


# -------------------------------------------------------------- adapter
def test_state_dict_adapter_round_trips():
    from titan_llama4.state_dict_adapter import Llama4StateDictAdapter

    cfg = dataclasses.replace(FLAVORS["debugmodel"], n_layers=2, dim=64, n_heads=4, vocab_size=64)
    from titan_llama4.model import build

    torch.manual_seed(0)
    model = build(cfg)
    model.init_weights()
    sd = model.state_dict()
    adapter = Llama4StateDictAdapter(cfg)
    assert adapter.from_torchtitan(adapter.to_torchtitan(sd)).keys() == sd.keys()
    hf = adapter.to_hf(sd)
    e, h, d = cfg.moe.num_experts, cfg.moe_hidden_dim, cfg.dim
    assert hf["model.layers.1.feed_forward.experts.gate_up_proj"].shape == (e, d, 2 * h)
    assert hf["model.layers.1.feed_forward.experts.down_proj"].shape == (e, h, d)
    assert "model.layers.0.feed_forward.gate_proj.weight" in hf and "lm_head.weight" in hf
    assert not any("expert_bias" in k for k in hf)
    # the multimodal layout (Llama4ForConditionalGeneration) reads back the same; its vision tower is not ours
    multimodal = {"language_model." + k: v for k, v in hf.items()} | {"vision_model.x.weight": torch.ones(1)}
    back = adapter.from_hf(multimodal)
    assert back.keys() == adapter.to_torchtitan(sd).keys()
    assert all(torch.equal(back[k], v) for k, v in adapter.to_torchtitan(sd).items())
    back = adapter.from_hf(hf)
    assert back.keys() == sd.keys()  # expert_bias re-created (zeros, as init_weights gives it)
    for key, value in back.items():
        assert torch.equal(value, sd[key]), key
