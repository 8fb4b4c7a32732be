"""``model=hf`` under context parallelism: transformers' own layers, this rank's
load-balanced chunks of each row, keys and values gathered over the cp group by the
attention function registered in transformers' ``AttentionInterface``
(``titan_hf.context_parallel``).

- masks and positions: a rank's rows of the mask equal the rows transformers' own mask
  builders make for the whole row (full and sliding layers);
- two gloo ranks, one step: loss and every gradient equal one process on the whole rows
  (Llama, Qwen3 with q/k norms, Gemma 3 with sliding + full layers and tied
  embeddings), causal and with document masks on packed rows;
- refusals before launch, one line each.

The titan-run runs (cp2, cp2 with documents, cp2_tp2 against one rank over 3 steps)
are test_hf_parallel's, sharing its launches.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("transformers")

from titan_plugins.components.attention_masks import AttentionMask  # noqa: E402
from titan_plugins.components.cp_attention import SequenceShard  # noqa: E402
from titan_plugins.errors import ConfigError  # noqa: E402

SEQ = 32
FLAVORS = ["tiny_llama", "tiny_qwen3", "tiny_gemma3"]


def _model(flavor: str, block_causal: bool):
    from titan_hf.config import FLAVORS as ALL
    from titan_hf.context_parallel import use_cp_attention
    from titan_hf.model import build

    config = ALL[flavor]
    if block_causal:
        config = dataclasses.replace(config, attn_mask=AttentionMask.block_causal)
    torch.manual_seed(0)
    model = build(config)
    with torch.no_grad():  # every weight matters (transformers' init is near zero)
        for p in model.parameters():
            p.normal_(0.0 if p.dim() > 1 or "gemma" in flavor else 1.0, 0.2)
    use_cp_attention(model)  # without a shard in flight it is transformers' SDPA
    return model


def test_a_ranks_masks_and_positions_are_its_rows_of_the_whole_rows():
    from titan_hf.config import FLAVORS as ALL
    from titan_hf.context_parallel import sharded_positions_and_masks
    from titan_hf.model import hf_config_object
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    hf = hf_config_object(ALL["tiny_gemma3"])
    hf._attn_implementation = "eager"  # a materialised mask (SDPA's builder returns None for plain causal)
    like = torch.empty(1, SEQ, 1)
    whole_pos = torch.arange(SEQ).unsqueeze(0)
    made = {"full_attention": create_causal_mask, "sliding_attention": create_sliding_window_causal_mask}
    want = {kind: make(config=hf, inputs_embeds=like, attention_mask=None, cache=None, position_ids=whole_pos) == 0
            for kind, make in made.items()}  # eager's additive mask: 0 where a query attends
    assert not torch.equal(want["full_attention"], want["sliding_attention"])  # the window cuts inside a row
    for rank in range(2):
        shard = SequenceShard(None, rank, 2, SEQ)
        positions, masks = sharded_positions_and_masks(shard, set(want), hf.sliding_window, None, torch.device("cpu"))
        rows = shard.positions(torch.device("cpu"))
        assert torch.equal(positions[0], rows)
        for kind, mask in masks.items():
            assert torch.equal(mask, want[kind].index_select(2, rows)), kind


def _grads_rank(rank: int, world: int, cases: list[tuple[str, bool]]) -> list[dict]:
    """Each case's loss and gradients: whole rows here, then this rank's chunks
    (``cp_step_against_whole_rows``)."""
    from titan_plugins.testing.model_parts import cp_step_against_whole_rows

    out = []
    for flavor, block_causal in cases:
        gen = torch.Generator().manual_seed(3)
        tokens = torch.randint(0, 8, (2, SEQ), generator=gen)  # id 2 (the flavors' EOS) ends documents
        diff = cp_step_against_whole_rows(_model(flavor, block_causal), tokens, torch.roll(tokens, -1, 1), rank, world)
        out.append({"case": (flavor, block_causal), **diff})
    return out


@pytest.mark.slow
def test_loss_and_gradients_on_two_ranks_equal_one_process():
    from titan_plugins.testing.gloo import run_ranks

    cases = [(flavor, docs) for flavor in FLAVORS for docs in (False, True)]
    results = run_ranks(_grads_rank, 2, cases, timeout=400)[0]
    for res in results:
        print(res)
        assert res["same_params"] and res["loss"] < 1e-5 and res["grad"] < 1e-5, res
    by_case = {tuple(r["case"]): r["ref_loss"] for r in results}
    for flavor in FLAVORS:  # the document masks change what is computed: the check is not vacuous
        assert abs(by_case[(flavor, False)] - by_case[(flavor, True)]) > 1e-4, flavor


@pytest.mark.parametrize("flavor, overrides, message", [
    ("tiny_gpt_oss", [], "parallelism.cp=2: transformers runs GptOssForCausalLM without SDPA"),
    ("tiny_llama", ["model.attn_implementation=eager"],
     "model.attn_implementation=eager with parallelism.cp=2: context parallel runs SDPA"),
])
def test_refused_in_one_line_before_launch(flavor, overrides, message):
    from titan_plugins.plugins import get_plugin_manager
    from titan_plugins.train.api import prepare_job

    with pytest.raises(ConfigError) as info:
        prepare_job(["model=hf", f"model.flavor={flavor}", "parallelism=cp2", "training.seq_len=32", *overrides],
                    get_plugin_manager(strict=True))
    assert message in str(info.value) and "\n" not in str(info.value), str(info.value)


@pytest.mark.parametrize("flavor, kv_width", [
    ("tiny_llama", 2 * 2 * 16),  # k_proj and v_proj: 2 KV heads of 16
    ("tiny_phi3", 2 * 2 * 16),  # a fused qkv_proj: its k and v share, from the config's head counts
])
def test_plan_sizes_the_key_value_exchange(flavor, kv_width):
    from titan_plugins.config.hydra_glue import compose, resolve_job
    from titan_plugins.plan import make_plan
    from titan_plugins.plugins import get_plugin_manager
    from titan_plugins.train.api import typed_job

    pm = get_plugin_manager(strict=True)
    spec, job = resolve_job(compose(["model=hf", f"model.flavor={flavor}", "data=synthetic", "data.vocab_size=256",
                                     "training.seq_len=64", "parallelism=fsdp2_cp2"], pm), pm)
    rank = make_plan(spec, typed_job(job), pm).ranks[0]
    gathers = [c for c in rank.collectives if c.mesh == "cp"]
    batch = int(job.training.local_batch_size)
    # 2 layers, each an all-gather of the whole row's keys and values and a reduce-scatter back, fp32
    assert {c.kind for c in gathers} == {"all_gather", "reduce_scatter"} and len(gathers) == 4
    assert all(c.bytes == batch * 64 * kv_width * 4 for c in gathers), [c.bytes for c in gathers]
    assert rank.activations.cp_mask_bytes == 32 * 64


@pytest.mark.slow
@pytest.mark.extended  # the core's test_expert_fsdp_mesh_spans_the_cp_peers checks the mesh in make test
def test_mixtral_fsdp2_cp2_ep2_equals_one_rank(tmp_path, capsys):
    """transformers' expert dispatch under context parallelism: each cp peer routes its own
    tokens, the experts' FSDP mesh sums their gradients over cp (measured: loss within
    4.8e-7 over 3 fp32 steps, final weights within 3.6e-7)."""
    from titan_plugins.cli.compare import main as compare_main

    base = ("model=hf model.flavor=tiny_mixtral data=synthetic data.vocab_size=256 training.seq_len=32 "
            "training.local_batch_size=2 metrics.tensorboard=false")
    rc = compare_main(["--baseline", base, "--test", f"{base} parallelism=fsdp2_cp2 parallelism.ep=2", "--steps", "3",
                       "--params", "--workdir", str(tmp_path / "work")])
    out = capsys.readouterr().out
    assert rc == 0 and out.rstrip().endswith("PASS"), out
