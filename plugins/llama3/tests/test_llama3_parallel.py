"""Parallelize hook on gloo, in-process (no trainer), ONE 4-rank launch for every layout:
each gives the single-process loss over 2 SGD steps (within the loss-parity tolerance)
and the single-process gradients, from the same weights and the same global batch.

The same launch loads saved transformers ``LlamaForCausalLM`` folders through
``model.hf`` (the config composed as ``titan-run`` does, the weights by
``load_hf_weights``: each rank reads its shards) under FSDP x TP and pipeline stages,
and its logits equal transformers' within 1e-5 (fp32)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from titan_plugins.compare.tolerances import LOSS_PARITY
from titan_plugins.testing.gloo import run_ranks

ATOL = 2e-5  # one fp32 backward: float reordering only
# Llama 3.1's shape in small: GQA 4/2, multiplier-sized SwiGLU, tiny vocab.
SMALL = {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 96,
         "ffn_dim_multiplier": 1.3, "multiple_of": 32, "max_seq_len": 64}
TIED = {**SMALL, "enable_weight_tying": True}  # Llama 3.2 1B/3B
TWO_STAGES = [{"keep": ["0"], "first": True, "last": False}, {"keep": ["1"], "first": False, "last": True}]
CASES = {  # name -> case (world 4); the presets' layouts, the extra ranks data-parallel
    "fsdp4": {"model": SMALL, "par": {"dp_shard": 4}},
    "fsdp2_tp2 tied": {"model": TIED, "par": {"dp_shard": 2, "tp": 2}},  # SP + loss parallel
    "hsdp2_fsdp2": {"model": SMALL, "par": {"dp_replicate": 2, "dp_shard": 2}},
    "tp2 dp_replicate2 bias no-SP": {"model": {**SMALL, "attention_bias": True},
                                     "par": {"dp_replicate": 2, "tp": 2, "sequence_parallel": False}},
    # pp2: two stages (the later one without tok_embeddings) chained on the same ranks,
    # hidden states crossing as plain local shards, each stage FSDP x TP; seq % tp != 0.
    "pp2 stages fsdp2_tp2": {"model": SMALL, "par": {"dp_shard": 2, "tp": 2}, "stages": TWO_STAGES, "seq": 15},
    "fsdp4 ac=full block_causal": {"model": {**SMALL, "attn_mask": "block_causal", "eos_id": 3},
                                   "par": {"dp_shard": 4}, "training": {"activation_checkpoint": "full"}},
}


HF_ATOL = 1e-5  # fp32 logits vs transformers
HF_LAYOUTS = {  # name -> (folder kind, extra config.json fields, parallelism, pipeline stages)
    "hf fsdp2_tp2 tied": ("3.2_tied", {}, {"dp_shard": 2, "tp": 2}, None),
    # GQA 4/2, biases, llama3 RoPE; each stage reads only its layers; FSDP splits k heads
    "hf pp2 stages fsdp2_tp2 bias": ("3.1", {"attention_bias": True}, {"dp_shard": 2, "tp": 2}, TWO_STAGES),
}


def hf_cases(tmp_path) -> tuple[list[dict], list]:
    """The sharded-load cases and transformers' logits for each (none without transformers)."""
    if importlib.util.find_spec("transformers") is None or importlib.util.find_spec("safetensors") is None:
        print("transformers or safetensors missing: the sharded model.hf loads are not checked")
        return [], []
    from llama3_hf_folders import SYNTH, hf_folder

    from titan_plugins.config.hydra_glue import model_config
    from titan_plugins.plugins import get_plugin_manager
    from titan_plugins.train.api import prepare_job

    pm = get_plugin_manager()
    tokens = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(3))
    cases, wants = [], []
    for i, (kind, extra, par, stages) in enumerate(HF_LAYOUTS.values()):
        folder, ref = hf_folder(tmp_path, kind, name=f"hf{i}", **extra)
        spec, job, _ = prepare_job(["model=llama3", f"model.hf={folder}", *SYNTH, "training.seq_len=16",
                                    "model.attn_backend=sdpa"], pm)
        with torch.no_grad():
            wants.append(ref(tokens).logits)
        cases.append({"hf": str(folder), "cfg": model_config(job.model, spec), "tokens": tokens, "par": par,
                      "stages": stages})
    return cases, wants


@pytest.mark.slow
def test_layouts_match_single_process(tmp_path):
    import llama3_dist_worker

    loads, wants = hf_cases(tmp_path)
    results = run_ranks(llama3_dist_worker.main, 4, [*CASES.values(), *loads])[0]
    for name, res, want in zip(HF_LAYOUTS, results[len(CASES):], wants, strict=False):
        diff = (res["logits"] - want).abs().max().item()
        print(f"{name}: max |logits - transformers| {diff:.1e}, entries loaded {res['loaded']} "
              f"(sliced {res['sliced']}, q/k read whole {res['permuted']}), kept {res['kept']}, tied {res['tied']}, "
              f"{res['seconds']:.1f} s")
        assert res["freqs_cis_plain"] and res["sharded_entries"] > 0, name  # the ranks really hold slices
        # each rank reads only its slices, but for the q/k rows (permuted between the
        # rotary layouts: read whole, one tensor at a time, then cut)
        tied = res["cfg"].enable_weight_tying  # output.weight: the embedding, not in the folder
        assert res["kept"] == 0 and res["tied"] == tied and res["loaded"] - res["sliced"] == res["permuted"] > 0, (name, res)
        assert diff <= HF_ATOL, (name, diff)
    assert len(results) == len(CASES) + len(loads)
    for name, res in zip(CASES, results, strict=False):
        print(f"{name}: losses {res['losses']} single {res['ref_losses']} max grad diff {res['max_grad_diff']:.1e}, "
              f"{res['seconds']:.1f} s")
        assert res["freqs_cis_plain"], name
        assert len(res["losses"]) == 2 and res["ref_losses"][0] != res["ref_losses"][1], name  # it trained
        for step, (a, b) in enumerate(zip(res["ref_losses"], res["losses"], strict=True), start=1):
            assert LOSS_PARITY.allows(a, b), f"{name} step {step}: {b!r} vs single {a!r}"
        assert res["max_grad_diff"] < ATOL, (name, res["worst"], res["max_grad_diff"])
    assert results[1]["logits_dtensor"] and not results[0]["logits_dtensor"]  # loss parallel under TP only
