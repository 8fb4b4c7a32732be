"""Context parallelism (parallelism.cp): the load-balanced chunks, the K/V all-gather
attention on 2 gloo ranks against one process, the refusals before launch, and
end-to-end layouts against one rank through titan-compare."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from titan_plugins.components.cp_attention import (
    SequenceShard,
    load_balanced_positions,
    rope_rows,
    shard_sequence,
    sharded_sequence,
    token_positions,
    unshard_sequence,
)
from titan_plugins.errors import ConfigError


# ------------------------------------------------------------------ in process
def test_each_rank_holds_a_head_chunk_and_its_mirror_tail():
    assert load_balanced_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert load_balanced_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    assert load_balanced_positions(16, 4, 1).tolist() == [2, 3, 12, 13]
    for cp in (1, 2, 3, 4):
        held = torch.cat([load_balanced_positions(24, cp, r) for r in range(cp)])
        assert sorted(held.tolist()) == list(range(24))
        # causal work per rank (sum of positions + 1) is the same on every rank
        work = {int((load_balanced_positions(24, cp, r) + 1).sum()) for r in range(cp)}
        assert len(work) == 1
    with pytest.raises(ValueError, match="does not split into 2\\*cp=4 equal chunks"):
        load_balanced_positions(10, 2, 0)


@pytest.mark.parametrize("cp", [1, 2, 3])
@pytest.mark.parametrize("dim", [0, 1, 2])
def test_shard_and_unshard_round_trip(cp, dim):
    x = torch.randn(12, 12, 12)
    shards = [shard_sequence(x, dim, cp, r) for r in range(cp)]
    assert all(s.shape[dim] == 12 // cp for s in shards)
    assert torch.equal(unshard_sequence(shards, dim), x)


def test_positions_and_rope_rows_follow_the_shard():
    table = torch.arange(32.0).view(16, 2)
    assert rope_rows(table) is table  # no shard in flight: unchanged
    assert token_positions(4, "cpu").tolist() == [0, 1, 2, 3]
    with sharded_sequence(SequenceShard(None, 1, 2, 16)):
        assert token_positions(8, "cpu").tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
        assert torch.equal(rope_rows(table), table[[4, 5, 6, 7, 8, 9, 10, 11]])
    assert rope_rows(table) is table


def test_causal_mask_is_the_rows_of_the_local_queries():
    from titan_plugins.components.attention_masks import dense_mask

    full = dense_mask(None, 16, 3, "cpu")[0, 0]  # chunked causal, one process
    for rank in range(2):
        shard = SequenceShard(None, rank, 2, 16)
        rows = full[load_balanced_positions(16, 2, rank)]
        assert torch.equal(shard.causal_mask("cpu")[0, 0], torch.tril(torch.ones(16, 16, dtype=torch.bool))[
            load_balanced_positions(16, 2, rank)])
        with sharded_sequence(shard):
            assert torch.equal(dense_mask(None, 8, 3, "cpu")[0, 0], rows)


# ------------------------------------------------------------------ refusals
@pytest.fixture(scope="module")
def pm():
    from titan_plugins.plugins import get_plugin_manager

    os.environ["TITAN_PLUGINS_EXTRA"] = "tiny_plugin"
    try:
        return get_plugin_manager(strict=True)
    finally:
        del os.environ["TITAN_PLUGINS_EXTRA"]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["model=tiny", "parallelism=cp2"], "model 'tiny' does not support parallelism.cp=2"),
        (["model=qwen3", "parallelism=cp2", "training.seq_len=30"],
         "training.seq_len=30 does not split into 2*cp=4 equal chunks"),
        (["model=qwen3", "parallelism=cp2", "training.compile=true"], "with training.compile=true: not done yet"),
        (["model=qwen3", "parallelism=cp2", "peft=qlora"], "with peft.method=qlora: not done yet"),
        (["model=qwen3", "parallelism=cp2", "model.attn_backend=flex"], "model.attn_backend=flex with parallelism.cp=2"),
        (["model=qwen3", "parallelism.cp=0"], "parallelism.cp=0 must be a positive integer"),
        (["model=qwen3", "parallelism=cp2", "parallelism.world_size=4"],
         "multiply to 2 (dp_replicate=1 x dp_shard=1 x cp=2 x tp=1 x pp=1)"),
    ],
)
def test_refused_in_one_line_before_launch(pm, overrides, message):
    from titan_plugins.train.api import prepare_job

    with pytest.raises(ConfigError) as info:
        prepare_job(overrides, pm)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_objectives_other_than_sft_dpo_and_grpo_are_refused(pm):
    from titan_plugins.distributed.context_parallel import check_context_parallel
    from titan_plugins.distributed.parallel_dims import ParallelDims
    from titan_plugins.train.api import prepare_job

    _, job, _ = prepare_job(["model=qwen3", "parallelism=cp2"], pm)
    dims = ParallelDims.from_config(job.parallelism)
    assert (dims.cp, dims.world_size, dims.fsdp_enabled) == (2, 2, True)
    assert "cp=2" in dims.describe()
    job.objective.name = "rloo"  # a third party's: its per-row terms know nothing of the cp group
    with pytest.raises(ConfigError, match="objective=rloo with parallelism.cp=2: not done yet"):
        check_context_parallel(job, "qwen3", None, dims)
    job.objective.name = "grpo"
    check_context_parallel(job, "qwen3", None, dims)
    job.objective.name = "dpo"
    check_context_parallel(job, "qwen3", None, dims)
    job.objective.precompute_ref = True
    with pytest.raises(ConfigError, match="objective.precompute_ref=true with parallelism.cp=2: not done yet"):
        check_context_parallel(job, "qwen3", None, dims)


# DPO under cp: a row's log-prob is summed over the cp group (row_sum), the pair losses
# are reported by the group's rank 0 (owns_rows) and reach every rank's tokens backward.
DPO_LOSSES = [("sigmoid", True), ("ipo", True), ("simpo", False), ("orpo", False)]


def _dpo_rank(rank: int, world: int, losses: list) -> list[dict]:
    """Each loss type's loss, metric sums and gradients: whole rows (2 pairs, the prompt
    masked) here, then this rank's chunks under ``sharded_sequence`` with the count,
    loss, sums and gradients summed over the ranks (as the train step and FSDP do)."""
    from omegaconf import OmegaConf
    from titan_qwen3.config import FLAVORS
    from titan_qwen3.model import build

    from titan_plugins.loss.token_loss import IGNORE_INDEX
    from titan_plugins.objectives.dpo import DPOObjective

    config = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(FLAVORS["debugmodel"]), {"n_layers": 2}))
    with torch.device("meta"):
        model = build(config)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.init_weights(buffer_device=torch.device("cpu"))
    gen = torch.Generator().manual_seed(5)
    inputs = torch.randint(0, 64, (4, 32), generator=gen)  # chosen rows 0-1, rejected rows 2-3
    labels = torch.roll(inputs, -1, 1)
    labels[:, :9] = IGNORE_INDEX  # the prompt: across the first cp chunk and into the mirror
    labels[3, 27:] = IGNORE_INDEX  # a shorter completion: the rows' lengths differ
    reference = torch.tensor([-150.0, -160.0, -155.0, -158.0])
    out = []
    for loss_type, with_ref in losses:
        objective = DPOObjective(OmegaConf.create({"loss_type": loss_type, "beta": 0.1}))

        def step(x, y, group=None, objective=objective, with_ref=with_ref):
            model.zero_grad(set_to_none=True)
            count = objective.count(y).double()
            if group is not None:
                dist.all_reduce(count, group=group)
            loss, stats = objective.loss(model(x), y, scale=tuple(count.tolist()),
                                         reference=reference if with_ref else None)
            loss.backward()
            flat = torch.stack([loss.detach(), *(stats[k].detach().float() for k in sorted(stats))])
            if group is not None:
                dist.all_reduce(flat, group=group)
            return flat, {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}

        ref_flat, ref = step(inputs, labels)
        with sharded_sequence(SequenceShard(dist.group.WORLD, rank, world, 32)):
            flat, grads = step(shard_sequence(inputs, 1, world, rank), shard_sequence(labels, 1, world, rank),
                               dist.group.WORLD)
        for g in grads.values():
            dist.all_reduce(g)
        worst = max((g - ref[n]).abs().max().item() / max(ref[n].abs().max().item(), 1e-6) for n, g in grads.items())
        out.append({"loss_type": loss_type, "loss": ref_flat[0].item(), "values": ((flat - ref_flat).abs() / ref_flat.abs().clamp(min=1)).max().item(),
                    "same_params": set(grads) == set(ref), "grad": worst})
    return out


@pytest.mark.slow
def test_dpo_losses_metrics_and_gradients_on_two_ranks_equal_one_process():
    from titan_plugins.testing.gloo import run_ranks

    pytest.importorskip("titan_qwen3")
    for res in run_ranks(_dpo_rank, 2, DPO_LOSSES, timeout=300)[0]:
        print(res)
        assert res["loss"] > 0 and res["same_params"], res
        assert res["values"] < 1e-5 and res["grad"] < 1e-5, res


# ------------------------------------------------------------------ 2 gloo ranks
CASES = [
    {"name": "causal MHA", "heads": 4, "kv": 4, "dqk": 8, "dv": 8},
    {"name": "block_causal GQA", "heads": 4, "kv": 2, "dqk": 8, "dv": 8, "docs": True},
    {"name": "chunked + documents (iRoPE)", "heads": 4, "kv": 1, "dqk": 8, "dv": 8, "docs": True, "chunk": 6},
    {"name": "MLA shapes (qk 24, v 16)", "heads": 2, "kv": 2, "dqk": 24, "dv": 16, "scale": 0.3},
]
SEQ, EOS = 24, 3


def _attention_rank(rank: int, world: int, cases: list[dict]) -> list[dict]:
    """Each case on the whole row in-process, then sharded over the ranks under
    ``sharded_sequence``: the local rows of the output and of every gradient."""
    from titan_plugins.components.attention import attend
    from titan_plugins.components.attention_masks import dense_mask, document_ids

    results = []
    for case in cases:
        gen = torch.Generator().manual_seed(7)
        b, h, kv, dqk, dv = 2, case["heads"], case["kv"], case["dqk"], case["dv"]
        q, k = (torch.randn(b, n, SEQ, dqk, generator=gen) for n in (h, kv))
        v, w = torch.randn(b, kv, SEQ, dv, generator=gen), torch.randn(b, h, SEQ, dv, generator=gen)
        tokens = torch.randint(0, 8, (b, SEQ), generator=gen)
        docs, chunk, gqa = case.get("docs", False), case.get("chunk"), h != kv
        kw = {"scale": case.get("scale"), "enable_gqa": gqa}

        ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
        doc = document_ids(tokens, EOS) if docs else None
        mask = dense_mask(doc, SEQ, chunk, "cpu") if (docs or chunk) else None
        ref = attend(*ref_in, mask, **kw)
        (ref * w).sum().backward()

        def local(t, dim=2):
            return shard_sequence(t, dim, world, rank)

        ins = [local(t).detach().clone().requires_grad_() for t in (q, k, v)]
        with sharded_sequence(SequenceShard(dist.group.WORLD, rank, world, SEQ)):
            doc_l = document_ids(local(tokens, 1), EOS) if docs else None  # EOS counted over the whole row
            mask_l = dense_mask(doc_l, SEQ // world, chunk, "cpu") if (docs or chunk) else None
            out = attend(*ins, mask_l, **kw)
            (out * local(w)).sum().backward()
        diff = {"out": (out - local(ref)).abs().max().item()}
        for name, got, want in zip("qkv", ins, ref_in):
            diff[f"d{name}"] = (got.grad - local(want.grad)).abs().max().item()
        if docs:
            diff["doc_ids"] = int(not torch.equal(doc_l, local(doc, 1)))
        results.append(diff)
    return results


@pytest.mark.slow
def test_all_gather_attention_on_two_ranks_equals_one_process():
    from titan_plugins.testing.gloo import run_ranks

    per_rank = run_ranks(_attention_rank, 2, CASES, timeout=240)
    for rank, results in enumerate(per_rank):
        for case, diff in zip(CASES, results):
            assert max(diff.values()) < 1e-5, (rank, case["name"], diff)


# One row of 32 tokens over 16 ids, EOS 5 (about two documents end in each row).
MODELS = [
    ("titan_qwen3", "debugmodel", {"n_layers": 2, "attn_mask": "block_causal", "eos_id": 5}),
    ("titan_llama3", "debugmodel", {"n_layers": 2, "attn_mask": "block_causal", "eos_id": 5}),
    # iRoPE: NoPE layers 0 and 4 (query temperature by position), chunks of 12 across the cp chunks of 8
    ("titan_llama4", "debugmodel_irope", {"n_layers": 5, "fixed_attn_block_size": 12, "eos_id": 5,
                                          "attn_temperature_tuning": True, "floor_scale": 4}),
    ("titan_deepseek_v3", "debugmodel", {"n_layers": 2, "max_seq_len": 64}),  # MLA, causal
    # DeepSeek-V3's sequence-wise balance loss: its per-row statistics summed over the cp peers
    ("titan_deepseek_v3", "debugmodel", {"n_layers": 2, "max_seq_len": 64,
                                         "layer": {"moe": {"seq_aux_loss_coeff": 0.01}}}),
]


def _model_grads_rank(rank: int, world: int, models: list) -> list[dict]:
    """Each model's loss and every gradient of one step on 2 rows: the whole rows in this
    process, then this rank's chunks (``cp_step_against_whole_rows``)."""
    import importlib

    from omegaconf import OmegaConf

    from titan_plugins.testing.model_parts import cp_step_against_whole_rows

    out = []
    for package, flavor, overrides in models:
        config_mod = importlib.import_module(f"{package}.config")
        config = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(config_mod.FLAVORS[flavor]), overrides))
        with torch.device("meta"):
            model = importlib.import_module(f"{package}.model").build(config)
        model.to_empty(device="cpu")
        torch.manual_seed(0)
        model.init_weights(buffer_device=torch.device("cpu"))
        gen = torch.Generator().manual_seed(3)
        tokens = torch.randint(0, 16, (2, 32), generator=gen)
        out.append({"model": package, **cp_step_against_whole_rows(model, tokens, torch.roll(tokens, -1, 1), rank, world)})
    return out


@pytest.mark.slow
def test_model_loss_and_gradients_on_two_ranks_equal_one_process():
    from titan_plugins.testing.gloo import run_ranks

    results = run_ranks(_model_grads_rank, 2, MODELS, timeout=400)[0]
    for res in results:
        print(res)
        assert res["same_params"] and res["loss"] < 1e-5 and res["grad"] < 1e-5, res


# ------------------------------------------------------------------ end to end
def _compare(tmp_path, capsys, model: str, test: str) -> str:
    from titan_plugins.cli.compare import main as compare_main

    base = f"{model} training.seq_len=32 training.local_batch_size=2 metrics.tensorboard=false"
    rc = compare_main(["--baseline", base, "--test", f"{base} {test}", "--steps", "3", "--params",
                       "--workdir", str(tmp_path / "work")])
    out = capsys.readouterr().out
    assert rc == 0 and out.rstrip().endswith("PASS"), out
    return out


def _loss_diff(out: str) -> float:
    line = next(x for x in out.splitlines() if x.startswith("loss: max abs diff"))
    return float(line.split()[4].rstrip(","))


# Synthetic rows over 16 token ids with id 5 as EOS: about two documents end in every
# row of 32, so block_causal masks cut across the cp chunks.
DOCS = "model.attn_mask=block_causal data=synthetic data.vocab_size=16 model.eos_id=5"


@pytest.mark.slow
@pytest.mark.extended  # test_qwen3_pp2_cp2_block_causal_equals_one_rank runs the same cp2 under a pipeline
def test_qwen3_cp2_block_causal_equals_one_rank(tmp_path, capsys):
    out = _compare(tmp_path, capsys, f"model=qwen3 {DOCS}", "parallelism=cp2")
    assert _loss_diff(out) < 1e-5, out


# Pipeline x cp: every stage runs on the rank's chunks; the later stage gets the whole
# rows' document ids through PipelineInfo.stage_inputs and rotary rows by global position.
@pytest.mark.slow
def test_qwen3_pp2_cp2_block_causal_equals_one_rank(tmp_path, capsys):
    out = _compare(tmp_path, capsys, f"model=qwen3 model.enable_weight_tying=false {DOCS}",
                   "parallelism.pp=2 parallelism.cp=2")
    assert _loss_diff(out) < 1e-5, out


@pytest.mark.slow
@pytest.mark.extended
@pytest.mark.parametrize("model", [
    f"model=llama4 model.n_layers=4 model.flavor=debugmodel_irope model.fixed_attn_block_size=12 {DOCS}",
    "model=deepseek_v3 model.n_layers=2",
    "model=hf model.flavor=tiny_llama data=synthetic data.vocab_size=256",
], ids=["llama4_irope_documents", "deepseek_v3", "hf_llama"])
def test_pp2_cp2_equals_one_rank(tmp_path, capsys, model):
    out = _compare(tmp_path, capsys, model, "parallelism.pp=2 parallelism.cp=2")
    assert _loss_diff(out) < 1e-5, out


@pytest.mark.slow
@pytest.mark.extended
def test_llama3_fsdp2_cp2_equals_one_rank(tmp_path, capsys):
    out = _compare(tmp_path, capsys, "model=llama3", "parallelism=fsdp2_cp2")
    assert _loss_diff(out) < 1e-5, out


# Expert parallel x cp: the cp peers route different tokens of the same rows to the same
# experts, so the experts' FSDP mesh spans cp (their gradients summed over it). Before, it
# did not: fsdp2_cp2 ep2 trained the experts on each peer's own tokens only (final
# experts.w2 3.98e-3 off one rank over 3 steps), which is why the combination was refused.
@pytest.mark.parametrize("etp", [1, 2])
def test_expert_fsdp_mesh_spans_the_cp_peers(etp):
    from titan_plugins.distributed.parallel_dims import ParallelDims
    from titan_plugins.plan.fake_world import fake_world

    tp = etp
    dims = ParallelDims(dp_replicate=1, dp_shard=2, tp=tp, pp=1, ep=2, etp=etp, world_size=4 * tp, cp=2)
    for rank in range(4 * tp):
        with fake_world(rank, 4 * tp):
            dims._meshes = {}
            dims.build_meshes("cpu")
            coords = {n: dims.world_mesh.get_local_rank(n) for n in dims.world_mesh.mesh_dim_names}
            experts, ep = dims.mesh("expert_fsdp"), dims.mesh("ep")
            assert experts.size() == 2 and ep.size() == 2 * (tp if etp == 1 else 1), (rank, experts, ep)
            assert experts.get_local_rank() == coords["cp"]  # the expert shards go to the cp peers
            assert ep.get_local_rank() == coords["dp_shard_in_ep"] * (tp if etp == 1 else 1) + (
                coords["tp"] if etp == 1 else 0)


@pytest.mark.slow
@pytest.mark.extended  # test_expert_fsdp_mesh_spans_the_cp_peers checks the mesh in make test
def test_qwen3_moe_fsdp2_cp2_ep2_equals_one_rank(tmp_path, capsys):
    out = _compare(tmp_path, capsys, "model=qwen3 model.flavor=debugmodel_moe model.n_layers=2",
                   "parallelism=fsdp2_cp2 parallelism.ep=2")
    assert _loss_diff(out) < 1e-5, out


# ------------------------------------------------------------------ plan=true
def test_plan_accounts_for_cp(pm):
    from titan_plugins.config.hydra_glue import compose, resolve_job
    from titan_plugins.plan import make_plan
    from titan_plugins.train.api import typed_job

    def plan(*overrides):
        spec, job = resolve_job(compose(["model=qwen3", "training.seq_len=1024", *overrides], pm), pm)
        return make_plan(spec, typed_job(job), pm).ranks[0]

    one, two = plan("parallelism=fsdp4"), plan("parallelism=fsdp2_cp2")
    assert two.activations.tokens_per_microbatch * 2 == one.activations.tokens_per_microbatch
    assert two.activations.cp_mask_bytes == 512 * 1024  # [1, 1, 512, 1024] booleans, causal
    assert 0.5 < two.activations.total_bytes / one.activations.total_bytes < 0.7
    gathers = [c for c in two.collectives if c.mesh == "cp"]
    # qwen3 debugmodel: 8 blocks, k and v of 8 heads x 128 each, fp32, batch 2 x 1024 tokens
    assert {c.kind for c in gathers} == {"all_gather", "reduce_scatter"} and len(gathers) == 16
    assert all(c.bytes == 2 * 1024 * 2048 * 4 for c in gathers)
    assert not [c for c in one.collectives if c.mesh == "cp"]
