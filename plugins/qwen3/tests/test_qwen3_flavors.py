"""Flavors, parameter counts on meta, config validation, plugin registration."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from titan_qwen3.config import FLAVORS, flops, num_params, validate
from titan_qwen3.model import build

from titan_plugins.config.schema import ParallelismConfig
from titan_plugins.errors import ConfigError
from titan_plugins.testing.model_parts import assert_imports_without_torch


def _meta_counts(flavor: str, **overrides) -> tuple[int, int]:
    cfg = dataclasses.replace(FLAVORS[flavor], **overrides)
    with torch.device("meta"):
        model = build(cfg)
    total = sum(p.numel() for p in model.parameters())  # unique: a tied weight once
    experts = sum(p.numel() for n, p in model.named_parameters() if ".moe.experts." in n)
    active = total - experts
    if cfg.moe_enabled:
        active += experts * cfg.moe.top_k // cfg.moe.num_experts
    return total, active


@pytest.mark.parametrize("flavor", sorted(FLAVORS))
def test_meta_build_matches_analytic_count(flavor):
    assert _meta_counts(flavor) == num_params(FLAVORS[flavor])


def test_dense_layers_inside_an_moe_model():
    """Hugging Face Qwen3-MoE's layer schedule: layer i is MoE unless it is in
    mlp_only_layers or (i + 1) % decoder_sparse_step != 0; dense blocks are SwiGLU of hidden_dim."""
    schedule = {"n_layers": 4, "decoder_sparse_step": 2, "mlp_only_layers": [3]}
    cfg = dataclasses.replace(FLAVORS["debugmodel_moe"], **schedule)
    with torch.device("meta"):
        model = build(cfg)
    assert [i for i, block in model.layers.items() if block.moe_enabled] == ["1"]
    assert model.layers["0"].feed_forward.w1.weight.shape == (cfg.hidden_dim, cfg.dim)
    assert _meta_counts("debugmodel_moe", **schedule) == num_params(cfg)
    assert flops(cfg, 64)[0] == num_params(cfg)[0]


@pytest.mark.parametrize(
    "flavor, total, active",
    [
        # Published sizes (Qwen3 model cards): 0.6B with tied embeddings, the MoE
        # models by total / activated parameters.
        ("0.6B", 0.6e9, None),
        ("1.7B", 1.7e9, None),
        ("4B", 4.0e9, None),
        ("8B", 8.2e9, None),
        ("14B", 14.8e9, None),
        ("32B", 32.8e9, None),
        ("30B-A3B", 30.5e9, 3.3e9),
        ("235B-A22B", 235e9, 22e9),
    ],
)
def test_published_sizes(flavor, total, active):
    n_total, n_active = _meta_counts(flavor)
    assert n_total == pytest.approx(total, rel=0.03)
    if active is not None:
        assert n_active == pytest.approx(active, rel=0.03)


def test_exact_counts():
    assert num_params(FLAVORS["0.6B"])[0] == 596_049_920
    assert num_params(FLAVORS["235B-A22B"]) == (235_093_634_560, 22_190_763_520)


def test_debug_flavors_are_torchtitans():
    c = FLAVORS["debugmodel"]
    assert (c.dim, c.n_layers, c.n_heads, c.n_kv_heads, c.head_dim) == (256, 8, 16, 8, 128)
    assert (c.vocab_size, c.hidden_dim, c.rope_theta, c.norm_eps) == (2048, 3072, 1e6, 1e-6)
    assert c.qk_norm and c.enable_weight_tying and not c.moe_enabled
    m = FLAVORS["debugmodel_moe"]
    assert m.moe_enabled and m.moe_inter_dim == 768
    assert (m.moe.num_experts, m.moe.top_k, m.moe.score_func.value, m.moe.route_norm) == (64, 8, "softmax", True)


def test_flops_counts_active_parameters():
    total, per_token = flops(FLAVORS["235B-A22B"], 4096)
    assert total == num_params(FLAVORS["235B-A22B"])[0]
    assert per_token > 6 * 21e9


def _par(**kw):
    return ParallelismConfig(**kw)


@pytest.mark.parametrize(
    "flavor, overrides, par, message",
    [
        ("debugmodel", {}, {"tp": 3}, "model.n_heads=16 is not divisible by parallelism.tp=3"),
        ("debugmodel", {"n_heads": 32, "n_kv_heads": 2}, {"tp": 4},
         "model.n_kv_heads=2 is not divisible by parallelism.tp=4"),
        ("debugmodel_moe", {}, {"ep": 3, "dp_shard": 3}, "model.moe.num_experts=64 is not divisible by parallelism.ep=3"),
        ("debugmodel", {}, {"ep": 2}, "needs an MoE flavor"),
        ("debugmodel_moe", {"n_layers": 2, "mlp_only_layers": [0, 1]}, {"ep": 2, "dp_shard": 2},
         "parallelism.ep=2 needs MoE layers, but model.mlp_only_layers / model.decoder_sparse_step=1 leave none"),
        ("debugmodel_moe", {"mlp_only_layers": [0], "hidden_dim": 3073}, {"tp": 2},
         "model.hidden_dim=3073 is not divisible by parallelism.tp=2"),
        ("debugmodel_moe", {"decoder_sparse_step": 0}, {}, "model.decoder_sparse_step=0 must be >= 1"),
        ("debugmodel_moe", {"mlp_only_layers": [-1]}, {}, "model.mlp_only_layers holds layer -1; layer indices are >= 0"),
        ("debugmodel", {}, {"pp": 2}, "model.enable_weight_tying=true cannot run with parallelism.pp=2"),
        ("debugmodel_moe", {"n_layers": 3}, {"pp": 4}, "model.n_layers=3 is fewer than the 4 pipeline stages"),
    ],
)
def test_validate_refuses(flavor, overrides, par, message):
    cfg = dataclasses.replace(FLAVORS[flavor], **overrides)
    with pytest.raises(ConfigError, match=message.replace(".", r"\.")) as info:
        validate(cfg, _par(**par))
    assert "\n" not in str(info.value)


def test_validate_accepts():
    validate(FLAVORS["debugmodel"], _par(tp=2, dp_shard=2))
    validate(FLAVORS["debugmodel_moe"], _par(tp=2, dp_shard=2, ep=2, pp=2))
    validate(FLAVORS["235B-A22B"], _par(tp=4, ep=64, dp_shard=64, pp=16))


def test_plugin_import_is_torch_free():
    assert_imports_without_torch("titan_qwen3.plugin", "titan_qwen3.config")


def test_plugin_registers_qwen3():
    import titan_qwen3.plugin as plugin

    from titan_plugins import ModelSpec

    specs = []
    plugin.titan_register_models(specs.append)
    (spec,) = specs
    assert isinstance(spec, ModelSpec) and spec.name == "qwen3"
    assert set(spec.flavor_names()) == {
        "debugmodel", "debugmodel_moe", "0.6B", "1.7B", "4B", "8B", "14B", "32B", "30B-A3B", "235B-A22B",
    }
    for attr in ("build", "parallelize", "validate", "state_dict_adapter", "flops", "config"):
        assert spec.load(attr) is not None
    assert plugin.titan_config_searchpath() == "pkg://titan_qwen3.conf"
