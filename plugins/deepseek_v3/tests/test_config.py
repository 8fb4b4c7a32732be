"""Schema, flavors, Hydra option, typed errors, validate, and a torch-free plugin."""

from __future__ import annotations

import pytest
from titan_deepseek_v3.config import FLAVORS, DeepSeekV3Config, ScoreFunc, make_config

from titan_plugins.errors import ConfigError
from titan_plugins.testing.model_parts import assert_imports_without_torch


def test_debugmodel_flavor_numbers():
    c = FLAVORS["debugmodel"]
    att, rope, moe = c.layer.attention, c.layer.rope, c.layer.moe
    assert (c.dim, c.n_layers, c.n_dense_layers, c.vocab_size) == (256, 6, 1, 2048)
    assert (att.n_heads, att.q_lora_rank, att.kv_lora_rank) == (16, 0, 512)
    assert (att.qk_nope_head_dim, att.qk_rope_head_dim, att.v_head_dim) == (128, 64, 128)
    assert (c.layer.ffn.hidden_dim, moe.hidden_dim) == (1024, 256)
    assert (moe.num_experts, moe.top_k, moe.num_shared_experts, moe.score_func) == (8, 3, 2, ScoreFunc.softmax)
    assert (rope.mscale, rope.theta, rope.factor, rope.beta_fast, rope.beta_slow) == (0.70, 1e4, 40, 32, 1)
    assert rope.original_seq_len == 4096 and c.layer.norm.eps == 1e-5


def test_make_config_shortcuts_and_errors():
    c = make_config(n_layers=2, n_heads=4, num_experts=4, moe__hidden_dim=64, max_seq_len=64)
    assert (c.n_layers, c.layer.attention.n_heads, c.layer.moe.num_experts, c.layer.moe.hidden_dim) == (2, 4, 4, 64)
    assert c.layer.ffn.hidden_dim == 1024  # untouched
    assert FLAVORS["debugmodel"].n_layers == 6  # flavors are not mutated
    assert make_config("16B", layer={"moe": {"top_k": 2}}).layer.moe.top_k == 2
    with pytest.raises(TypeError, match="ambiguous"):
        make_config(hidden_dim=8)
    with pytest.raises(TypeError, match="unknown key 'n_head'"):
        make_config(n_head=8)
    with pytest.raises(TypeError, match="n_layers"):
        make_config(n_layers="many")
    with pytest.raises(ConfigError, match="n_dense_layers=3"):
        make_config(n_layers=2, n_dense_layers=3)


@pytest.fixture(scope="module")
def pm():
    from titan_plugins.plugins import get_plugin_manager

    return get_plugin_manager(strict=False)


def compose(pm, *overrides):
    from titan_plugins.config import hydra_glue

    cfg = hydra_glue.compose(["model=deepseek_v3", *overrides], pm)
    spec, job = hydra_glue.resolve_job(cfg, pm)
    return hydra_glue.model_config(job.model, spec)


def test_discovered_through_the_entry_point(pm):
    info = pm.model_owner("deepseek_v3")
    assert info.dist == "titan-deepseek-v3" and info.module == "titan_deepseek_v3.plugin"


def test_hydra_option_flavor_and_overrides(pm):
    c = compose(pm, "model.n_layers=4", "model.layer.moe.top_k=2", "training.seq_len=64")
    assert isinstance(c, DeepSeekV3Config)
    assert (c.dim, c.n_layers, c.layer.moe.top_k) == (256, 4, 2)
    # As TorchTitan's trainer: max_seq_len follows training.seq_len unless overridden.
    assert c.max_seq_len == 64 and not c.yarn_enabled
    c = compose(pm, "model.flavor=671B", "model.max_seq_len=8192")
    assert (c.dim, c.layer.attention.q_lora_rank, c.max_seq_len, c.yarn_enabled) == (7168, 1536, 8192, True)


@pytest.mark.parametrize(
    "override, message",
    [
        ("model.n_layers=abc", "model.n_layers=abc"),
        ("model.layer.attention.nheads=3", "nheads"),
        ("model.flavor=7B", "7B"),
        ("model.layer.moe.score_func=relu", "score_func"),
    ],
)
def test_bad_overrides_are_typed_config_errors(pm, override, message):
    from titan_plugins.errors import ConfigError

    with pytest.raises(ConfigError, match=message):
        compose(pm, override)


def test_validate_names_both_numbers():
    from titan_deepseek_v3.config import validate

    from titan_plugins.distributed.parallel_dims import ParallelDims
    from titan_plugins.errors import ConfigError

    def dims(**kw):
        base = dict(dp_replicate=1, dp_shard=1, tp=1, pp=1, ep=1, etp=1, world_size=1)
        return ParallelDims(**{**base, **kw})

    validate(FLAVORS["debugmodel"], dims(dp_shard=4, tp=2, ep=2))
    validate(FLAVORS["671B"], dims(dp_shard=64, tp=8, ep=32, pp=16))
    with pytest.raises(ConfigError, match=r"n_heads=16 is not divisible by parallelism.tp=3"):
        validate(FLAVORS["debugmodel"], dims(tp=3))
    with pytest.raises(ConfigError, match=r"num_experts=8 is not divisible by parallelism.ep=3"):
        validate(FLAVORS["debugmodel"], dims(ep=3))
    with pytest.raises(ConfigError, match=r"n_layers=2 is fewer than parallelism.pp=4"):
        validate(make_config(n_layers=2), dims(pp=4))


def test_plugin_and_config_import_without_torch():
    assert_imports_without_torch("titan_deepseek_v3.plugin", "titan_deepseek_v3.config")


def test_hf_numerics_fields_default_to_torchtitan():
    from titan_deepseek_v3.config import to_torchtitan

    config = make_config(max_seq_len=64)
    assert not config.yarn_enabled and config.layer.norm.latent == config.layer.norm.eps
    assert config.layer.norm.final_eps is None and config.layer.rope.attention_factor == 1.0
    assert make_config(max_seq_len=64, scaling="yarn").yarn_enabled
    assert not make_config(max_seq_len=8192, scaling="none").yarn_enabled
    to_torchtitan(config)
    with pytest.raises(ConfigError, match="latent_eps=1e-06"):
        to_torchtitan(make_config(latent_eps=1e-6))
    with pytest.raises(ConfigError, match="final_eps=0"):
        make_config(final_eps=0.0)
