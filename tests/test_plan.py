"""``plan=true``: the plan at full scale in one process (fake process group, meta model).

The at-scale tests need the first-party plugins (installed editable); they are
skipped where those are missing. The gloo comparison starts 4 real ranks (``run_ranks``).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from titan_plugins.config.hydra_glue import compose, resolve_job
from titan_plugins.errors import ConfigError
from titan_plugins.plugins import get_plugin_manager
from titan_plugins.testing.gloo import run_ranks

TESTS = Path(__file__).resolve().parent


@pytest.fixture(autouse=True)
def _tiny_plugin(monkeypatch):
    monkeypatch.syspath_prepend(str(TESTS))
    monkeypatch.setenv("TITAN_PLUGINS_EXTRA", "tiny_plugin")
    monkeypatch.delenv("WORLD_SIZE", raising=False)


def _job(overrides):
    from titan_plugins.train.api import typed_job

    pm = get_plugin_manager(strict=True)
    spec, job = resolve_job(compose(list(overrides), pm), pm)
    return spec, typed_job(job), pm


def _plan(overrides):
    from titan_plugins.plan import make_plan

    spec, job, pm = _job(overrides)
    return make_plan(spec, job, pm)


def _needs(model):
    pm = get_plugin_manager()
    if model not in pm.models():
        pytest.skip(f"plugin for model {model!r} is not installed")


# --------------------------------------------------------------- the report
def test_text_report_and_exit_code(capsys):
    from titan_plugins.plan import run_plan

    spec, job, pm = _job(["model=tiny", "parallelism=fsdp2_tp2_pp2", "plan=true"])
    assert run_plan(spec, job, pm) == 0
    out = capsys.readouterr().out
    assert out.startswith("plan: tiny debugmodel on 8 ranks (dp_replicate=1 dp_shard=2 cp=1 tp=2 pp=2")
    assert "meshes: world pp=2" in out
    assert "rank 0 (" in out and "rank 4 (" in out  # rank 0 and the first rank of the last stage
    assert "stage 0: layers.0-1 + tok_embeddings" in out
    assert "stage 1: layers.2-3 + norm, output" in out
    for word in ("parameters", "gradients", "optimizer", "activations", "all_gather dp_shard(2)",
                 "reduce_scatter tp(2)", "send_recv pp(2)"):
        assert word in out
    assert out.rstrip().splitlines()[-1].startswith("summary: peak ")
    assert ": fits (" in out


def test_json_report(capsys):
    from titan_plugins.plan import run_plan

    spec, job, pm = _job(["model=tiny", "parallelism=fsdp2_tp2", "plan=true", "plan.json=true",
                          "plan.ranks=[1,3]"])
    assert run_plan(spec, job, pm) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["world_size"] == 4 and data["degrees"]["tp"] == 2
    assert data["meshes"]["tp"] == 2 and data["meshes"]["dp_shard"] == 2
    assert [r["rank"] for r in data["ranks"]] == [1, 3]
    r = data["ranks"][0]
    assert r["coords"]["tp"] == 1
    mem = r["memory_bytes"]
    assert mem["peak"] == data["summary"]["peak_bytes"] or data["summary"]["peak_rank"] == 3
    assert mem["optimizer"]["float32"] >= 2 * mem["gradients"]["float32"]
    assert {c["kind"] for c in r["collectives"]} >= {"all_gather", "reduce_scatter"}
    assert data["summary"]["fits"] is True


def test_nothing_is_allocated():
    import torch

    plan = _plan(["model=tiny", "parallelism=fsdp4_tp2", "plan=true"])
    assert not torch.distributed.is_initialized()  # the fake group is gone again
    assert plan.ranks[0].memory.numel > 0


# --------------------------------------------------------- errors = launch's
def _launch_error(overrides):
    from titan_plugins.train.api import prepare_job

    with pytest.raises(ConfigError) as launch:
        prepare_job(overrides, get_plugin_manager(strict=True))
    return str(launch.value)


@pytest.mark.parametrize("overrides", [
    # degrees do not multiply to the world size
    ["model=tiny", "parallelism.dp_shard=3", "parallelism.tp=2", "parallelism.world_size=8"],
    # ETP must be 1 or TP
    ["model=tiny", "parallelism=fsdp2_tp2", "parallelism.etp=4"],
    # EP borrowing: ep not a multiple of tp (etp=1)
    ["model=tiny", "parallelism=fsdp2_tp2", "parallelism.ep=3"],
    # head divisibility (the plugin's validate)
    ["model=tiny", "parallelism.tp=3", "parallelism.world_size=3"],
    # more stages than layers (layers per stage)
    ["model=tiny", "parallelism.pp=8", "training.local_batch_size=8", "parallelism.world_size=8"],
    # microbatches
    ["model=tiny", "parallelism=pp2", "training.local_batch_size=3"],
])
def test_plan_reports_the_launch_error(overrides):
    expected = _launch_error(overrides)
    with pytest.raises(ConfigError) as planned:
        _plan([*overrides, "plan=true"])
    assert str(planned.value) == expected
    assert "\n" not in expected


def test_tied_embeddings_with_pp_error_matches_launch():
    _needs("qwen3")
    overrides = ["model=qwen3", "model.flavor=0.6B", "parallelism=pp2"]
    expected = _launch_error(overrides)
    assert "enable_weight_tying" in expected
    with pytest.raises(ConfigError) as planned:
        _plan([*overrides, "plan=true"])
    assert str(planned.value) == expected


def test_plan_world_size_fills_dp_shard():
    plan = _plan(["model=tiny", "parallelism.dp_shard=-1", "parallelism.tp=2", "plan=true",
                  "plan.world_size=16"])
    assert plan.world_size == 16 and plan.degrees["dp_shard"] == 8
    same = _plan(["model=tiny", "parallelism.dp_shard=-1", "parallelism.tp=2", "plan=true",
                  "parallelism.world_size=16"])  # the one key; plan.world_size is its other spelling
    assert same.world_size == 16 and same.degrees == plan.degrees
    with pytest.raises(ConfigError, match=r"^parallelism.world_size=0 must be a positive integer$"):
        _plan(["model=tiny", "parallelism.dp_shard=-1", "plan=true", "plan.world_size=0"])
    with pytest.raises(ConfigError, match="plan.ranks: rank 99 is outside the world of 16 ranks"):
        _plan(["model=tiny", "parallelism.dp_shard=-1", "plan=true", "plan.world_size=16",
               "plan.ranks=[99]"])


# ------------------------------------------------------------------ at scale
DSV3_2048 = ["model=deepseek_v3", "model.flavor=671B", "parallelism.dp_shard=-1", "parallelism.tp=8",
             "parallelism.pp=16", "parallelism.ep=64", "plan=true", "plan.world_size=2048",
             "training.local_batch_size=16", "training.seq_len=4096", "precision=bf16_mixed",
             "training.activation_checkpoint=full"]


def _ceil(a, b):
    return -(-a // b)


def _deepseek_rank0_numel(c, tp, fsdp, ep, expert_fsdp, layers):
    """Rank 0's parameters by hand: TP shards first (colwise: out rows / tp,
    rowwise: in cols / tp, replicated: whole), EP splits experts, then FSDP takes the
    first ceil(rows / fsdp) rows of dim 0 (rank 0 is shard 0 on every mesh)."""
    a, m, dim = c.layer.attention, c.layer.moe, c.dim

    def fsdp_shard(rows, cols=1, world=fsdp):
        return _ceil(rows, world) * cols

    attn = (
        fsdp_shard(a.q_lora_rank, dim) + fsdp_shard(a.q_lora_rank)                     # wq_a, q_norm
        + fsdp_shard(a.n_heads * (a.qk_nope_head_dim + a.qk_rope_head_dim) // tp, a.q_lora_rank)  # wq_b
        + fsdp_shard(a.kv_lora_rank + a.qk_rope_head_dim, dim) + fsdp_shard(a.kv_lora_rank)  # wkv_a, kv_norm
        + fsdp_shard(a.n_heads * (a.qk_nope_head_dim + a.v_head_dim) // tp, a.kv_lora_rank)  # wkv_b
        + fsdp_shard(dim, a.n_heads * a.v_head_dim // tp)                               # wo (rowwise)
        + 2 * fsdp_shard(dim)                                                           # the two norms
    )
    h = c.layer.ffn.hidden_dim
    dense_ffn = 2 * fsdp_shard(h // tp, dim) + fsdp_shard(dim, h // tp)
    local_experts = m.num_experts // ep
    experts = 3 * fsdp_shard(local_experts, m.hidden_dim * dim, world=expert_fsdp)
    hs = m.hidden_dim * m.num_shared_experts  # shared experts replicated on tp (EP, ETP=1)
    moe = experts + fsdp_shard(m.num_experts, dim) + 2 * fsdp_shard(hs, dim) + fsdp_shard(dim, hs)
    total = fsdp_shard(c.vocab_size // tp, dim)  # tok_embeddings, row-parallel on the vocab
    for i in layers:
        total += attn + (dense_ffn if i < c.n_dense_layers else moe)
    return total


def test_deepseek_v3_671b_at_2048_ranks():
    _needs("deepseek_v3")
    from titan_deepseek_v3.config import FLAVORS

    start = time.perf_counter()
    plan = _plan(DSV3_2048)
    elapsed = time.perf_counter() - start
    assert elapsed < 60, f"the 671B plan took {elapsed:.1f} s"
    assert plan.world_size == 2048
    assert plan.degrees == {"dp_replicate": 1, "dp_shard": 16, "cp": 1, "tp": 8, "pp": 16, "ep": 64, "etp": 1}
    assert plan.meshes["ep"] == 64 and plan.meshes["expert_fsdp"] == 2 and plan.meshes["pp"] == 16
    r0, last = plan.ranks
    assert (r0.rank, last.rank) == (0, 1920)
    assert r0.stages[0]["layers"] == "layers.0-3" and "tok_embeddings" in r0.stages[0]["modules"]
    assert last.stages[0]["layers"] == "layers.58-60" and "lm_head" in last.stages[0]["modules"]
    expected = _deepseek_rank0_numel(FLAVORS["671B"], tp=8, fsdp=16, ep=64, expert_fsdp=2, layers=range(4))
    assert r0.memory.numel == expected
    assert r0.memory.parameters == {"float32": pytest.approx(4 * expected, rel=1e-3)}
    kinds = {(c.kind, c.mesh) for c in r0.collectives}
    assert {("all_gather", "dp_shard"), ("reduce_scatter", "expert_fsdp"), ("all_to_all", "ep"),
            ("all_gather", "tp"), ("send_recv", "pp")} <= kinds
    assert plan.fits


def test_qwen3_235b_at_512_ranks():
    _needs("qwen3")
    start = time.perf_counter()
    plan = _plan(["model=qwen3", "model.flavor=235B-A22B", "parallelism.dp_shard=16",
                  "parallelism.tp=4", "parallelism.pp=8", "parallelism.ep=32", "plan=true",
                  "training.local_batch_size=8", "training.seq_len=4096", "precision=bf16_mixed",
                  "training.activation_checkpoint=full"])
    elapsed = time.perf_counter() - start
    assert elapsed < 60, f"the 235B plan took {elapsed:.1f} s"
    assert plan.world_size == 512 and [r.rank for r in plan.ranks] == [0, 448]
    assert plan.ranks[0].stages[0]["n_layers"] == 12 and plan.ranks[1].stages[0]["n_layers"] == 11
    assert all(r.memory.numel > 0 for r in plan.ranks)
    assert plan.fits


def test_a_plan_that_cannot_fit_says_so(capsys):
    _needs("qwen3")
    from titan_plugins.plan import run_plan

    # 235B parameters with AdamW on 8 ranks: ~16 bytes/param / 8 = ~470 GB per rank.
    spec, job, pm = _job(["model=qwen3", "model.flavor=235B-A22B", "parallelism=fsdp8", "plan=true",
                          "plan.device_memory_gb=141"])
    assert run_plan(spec, job, pm) == 1
    last = capsys.readouterr().out.rstrip().splitlines()[-1]
    assert "DOES NOT FIT" in last and "plan.device_memory_gb=141" in last


# --------------------------------------------------- plan vs a real gloo run
def _gloo_rank(rank: int, world: int, overrides: list[str]) -> dict[str, int]:
    import torch
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    from titan_plugins.distributed.parallel_dims import ParallelDims
    from titan_plugins.model.lifecycle import build_model_parts

    spec, job, pm = _job(overrides)
    dims = ParallelDims.from_config(job.parallelism, world_size=world)
    dims.build_meshes("cpu")
    parts = build_model_parts(spec, job, dims, torch.device("cpu"), pm, init=False).parts
    for part in parts:  # what the first forward does first: FSDP's padded shards
        if isinstance(part, FSDPModule):
            part._get_fsdp_state()._lazy_init()
    numel, stored, seen = 0, 0, set()
    for part in parts:
        for p in part.parameters():
            local = p._local_tensor if isinstance(p, DTensor) else p
            numel += local.numel()
            storage = local.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                stored += storage.nbytes()
    return {"numel": numel, "bytes": stored}


@pytest.mark.slow
@pytest.mark.parametrize("model,overrides", [
    ("deepseek_v3", ["model=deepseek_v3", "parallelism=fsdp2_tp2_ep2"]),
    ("tiny", ["model=tiny", "parallelism=fsdp2_pp2", "training.local_batch_size=2"]),
])
def test_debugmodel_parameter_memory_equals_gloo(model, overrides):
    if model != "tiny":
        _needs(model)
    world = 4
    # fork: the ranks reuse the plugins and Hydra this process has loaded (the fork
    # server's ranks would load and compose them again, ~2x this test's time)
    real = run_ranks(_gloo_rank, world, overrides, start_method="fork")
    plan = _plan([*overrides, "plan=true", f"plan.ranks=[{','.join(map(str, range(world)))}]"])
    for r in plan.ranks:
        assert r.memory.numel == real[r.rank]["numel"], f"rank {r.rank}"
        assert r.memory.total("parameters") == real[r.rank]["bytes"], f"rank {r.rank}"


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
