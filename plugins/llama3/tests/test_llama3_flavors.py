"""Flavors, parameter counts, validation, the state-dict adapter and the 405B plan."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from titan_llama3.config import FLAVORS, flops, num_params, validate
from titan_llama3.model import build
from titan_llama3.state_dict_adapter import Llama3StateDictAdapter

from titan_plugins.config.schema import ParallelismConfig
from titan_plugins.errors import ConfigError

# Published sizes: Llama 3.1 8B/70B/405B, Llama 3.2 1B/3B (tied), SwiGLU hidden sizes.
PUBLISHED = {"1B": (1_235_814_400, 8192), "3B": (3_212_749_824, 8192), "8B": (8_030_261_248, 14336),
             "70B": (70_553_706_496, 28672), "405B": (405_853_388_800, 53248)}


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_flavor_sizes_match_published_and_meta_build(name):
    cfg = FLAVORS[name]
    total, hidden = PUBLISHED[name]
    assert cfg.ffn_hidden_dim == hidden and num_params(cfg) == total
    small = dataclasses.replace(cfg, n_layers=1, max_seq_len=16)
    with torch.device("meta"):
        model = build(small)
    assert sum(p.numel() for p in model.parameters()) == num_params(small)
    assert flops(cfg, 8192)[1] > 6 * (total - cfg.vocab_size * cfg.dim)


def test_debugmodel_is_torchtitans():
    c = FLAVORS["debugmodel"]
    assert (c.dim, c.n_layers, c.n_heads, c.kv_heads, c.vocab_size, c.ffn_hidden_dim) == (256, 6, 16, 16, 2048, 768)
    assert c.rope_theta == 500000.0 and c.rope_scaling.enabled and c.rope_scaling.scaling_factor == 8.0


@pytest.mark.parametrize(
    ("overrides", "par", "message"),
    [({}, {"tp": 3}, "model.n_heads=16 is not divisible by parallelism.tp=3"),
     ({"enable_weight_tying": True}, {"pp": 2}, "model.enable_weight_tying=true cannot run with parallelism.pp=2"),
     ({"n_layers": 1}, {"pp": 2}, "model.n_layers=1 is fewer than the 2 pipeline stages"),
     ({}, {"ep": 2}, "parallelism.ep=2 needs experts"),
     ({"n_kv_heads": 5}, {}, "model.n_heads=16 is not divisible by model.n_kv_heads=5")],
)
def test_validate_names_both_numbers(overrides, par, message):
    cfg = dataclasses.replace(FLAVORS["debugmodel"], **overrides)
    with pytest.raises(ConfigError, match=message) as info:
        validate(cfg, ParallelismConfig(**par))
    assert "\n" not in str(info.value)


def test_hf_adapter_round_trip_permutes_qk():
    cfg = dataclasses.replace(FLAVORS["debugmodel"], n_layers=1, n_kv_heads=4, attention_bias=True, max_seq_len=8)
    model = build(cfg)
    adapter = Llama3StateDictAdapter(cfg)
    sd = model.state_dict()
    hf = adapter.to_hf(sd)
    assert "model.layers.0.self_attn.q_proj.bias" in hf and "lm_head.weight" in hf
    # rows move within a head: q row 1 (pair 0, odd) becomes the first row of the second half
    head = cfg.head_size
    assert torch.equal(hf["model.layers.0.self_attn.q_proj.weight"][head // 2], sd["layers.0.attention.wq.weight"][1])
    assert not torch.equal(hf["model.layers.0.self_attn.k_proj.weight"], sd["layers.0.attention.wk.weight"])
    back = adapter.from_hf(hf)
    assert sorted(back) == sorted(sd) and all(torch.equal(back[k], sd[k]) for k in sd)
    tied = dataclasses.replace(cfg, enable_weight_tying=True)
    tied_hf = Llama3StateDictAdapter(tied).to_hf(build(tied).state_dict())
    assert "lm_head.weight" not in tied_hf
    assert "output.weight" in Llama3StateDictAdapter(tied).from_hf(tied_hf)


def test_405b_plan_at_512_ranks_in_one_process():
    import time

    from titan_plugins.config.hydra_glue import compose, resolve_job
    from titan_plugins.plan import make_plan
    from titan_plugins.plugins import get_plugin_manager
    from titan_plugins.train.api import typed_job

    pm = get_plugin_manager(strict=True)
    start = time.perf_counter()
    spec, job = resolve_job(compose(["model=llama3", "model.flavor=405B", "parallelism.dp_shard=16",
                                     "parallelism.tp=8", "parallelism.pp=4", "plan=true",
                                     "training.local_batch_size=4", "training.seq_len=8192",
                                     "precision=bf16_mixed", "training.activation_checkpoint=full"], pm), pm)
    plan = make_plan(spec, typed_job(job), pm)
    elapsed = time.perf_counter() - start
    assert elapsed < 60, f"the 405B plan took {elapsed:.1f} s"
    assert plan.world_size == 512 and plan.degrees["tp"] == 8 and plan.degrees["pp"] == 4
    assert [r.rank for r in plan.ranks] == [0, 384]  # rank 0 and the first rank of the last stage
    assert plan.ranks[0].stages[0]["n_layers"] + plan.ranks[1].stages[0]["n_layers"] < 126
    assert all(r.memory.numel > 0 for r in plan.ranks)
