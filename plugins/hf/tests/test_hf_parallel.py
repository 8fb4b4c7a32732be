"""``titan-run model=hf model.hf=DIR`` through the real trainer (gloo ranks), every layout
equal to one rank within 1e-5 over 3 fp32 steps on the same global batch:

- one rank's step-1 loss equals the plain transformers model's on the same batch (Gemma 3);
- ``make test``: Gemma 3 fsdp2 and fsdp2_tp2 (tied embeddings, scaled embedding, sliding +
  full layers, per-head q/k norms whose TP gradient must be summed; SP and loss parallel
  on), Mistral pp2, Mixtral fsdp2_ep2 (transformers' expert-parallel plan), Gemma 3 cp2
  and, on packed rows with document masks, cp2_tp2 (context parallel: titan_hf.context_parallel);
- extended: Llama fsdp2_tp2 and pp2, Qwen3 fsdp2_tp2, Mistral, Phi-3, OLMo-2 and Mixtral
  on fsdp2, fsdp2_tp2 and pp2, Phi-3 tp2
  without SP and pp2_tp2, Mixtral tp2_ep2, Qwen3-MoE fsdp2_ep2 and fsdp2_tp2_ep2, GPT-OSS
  pp2, fsdp2 with full activation checkpointing and fsdp2_ep2; Llama cp2 and OLMo-2
  cp2_tp2 with document masks, Qwen3 fsdp2_cp2; PhiMoE tp2 (experts sampled in training)
  with and without rank 0's CPU peak probe.

Mixtral's and Qwen3-MoE's TP layouts run without SP (their plan leaves the MoE block
out). The jobs of one world size share one launch (``train_in_one_launch``), and every
run starts from the folder's weights, so no seed checkpoint is needed.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
from titan_hf.testing import reference_model, save_folder, train_in_one_launch  # noqa: E402

from titan_plugins.compare.runner import match_global_batch  # noqa: E402

STEPS = 3
COMMON = ["model=hf", "data=synthetic", "data.vocab_size=256", f"training.steps={STEPS}",
          "training.deterministic=true", "training.seq_len=16", "training.local_batch_size=4",
          "training.lr=1e-3", "training.warmup_steps=0", "metrics.tensorboard=false", "metrics.console=false"]
NO_SP = "parallelism.sequence_parallel=false"
# layout -> (world size, overrides)
LAYOUTS: dict[str, tuple[int, list[str]]] = {
    "fsdp2": (2, ["parallelism=fsdp2"]),
    "pp2": (2, ["parallelism=pp2"]),
    "tp2_nosp": (2, ["parallelism=tp2", NO_SP]),
    "fsdp2_ac": (2, ["parallelism=fsdp2", "training.activation_checkpoint=full"]),
    "fsdp2_ep2": (2, ["parallelism=fsdp2_ep2"]),
    "tp2_ep2_nosp": (2, ["parallelism=tp2_ep2", NO_SP]),
    "fsdp2_tp2": (4, ["parallelism=fsdp2_tp2"]),
    "fsdp2_tp2_nosp": (4, ["parallelism=fsdp2_tp2", NO_SP]),
    "pp2_tp2": (4, ["parallelism=pp2_tp2"]),
    "fsdp2_tp2_ep2_nosp": (4, ["parallelism=fsdp2_tp2_ep2", NO_SP]),
    "cp2": (2, ["parallelism=cp2"]),
    "cp2_tp2": (4, ["parallelism=cp2_tp2"]),
    "fsdp2_cp2": (4, ["parallelism=fsdp2_cp2"]),
}
# "<flavor>+docs": packed rows with document masks (ids 0..7, the flavors' EOS id 2 ends
# a document about every 8 tokens), baseline and layout alike
VARIANTS = {"docs": ["model.attn_mask=block_causal", "data.vocab_size=8"]}
DEFAULT = [("tiny_gemma3", "fsdp2"), ("tiny_gemma3", "fsdp2_tp2"), ("tiny_mistral", "pp2"),
           ("tiny_mixtral", "fsdp2_ep2"), ("tiny_gemma3", "cp2"), ("tiny_gemma3+docs", "cp2_tp2")]
EXTENDED = [
    ("tiny_llama", "fsdp2_tp2"), ("tiny_llama", "pp2"), ("tiny_qwen3", "fsdp2_tp2"),
    ("tiny_mistral", "fsdp2"), ("tiny_mistral", "fsdp2_tp2"),
    ("tiny_phi3", "fsdp2"), ("tiny_phi3", "fsdp2_tp2"), ("tiny_phi3", "pp2"), ("tiny_phi3", "tp2_nosp"),
    ("tiny_phi3", "pp2_tp2"),
    ("tiny_olmo2", "fsdp2"), ("tiny_olmo2", "fsdp2_tp2"), ("tiny_olmo2", "pp2"),
    ("tiny_mixtral", "fsdp2"), ("tiny_mixtral", "fsdp2_tp2_nosp"), ("tiny_mixtral", "pp2"),
    ("tiny_mixtral", "tp2_ep2_nosp"),
    ("tiny_qwen3_moe", "fsdp2_ep2"), ("tiny_qwen3_moe", "fsdp2_tp2_ep2_nosp"),
    ("tiny_gpt_oss", "pp2"), ("tiny_gpt_oss", "fsdp2_ac"), ("tiny_gpt_oss", "fsdp2_ep2"),
    ("tiny_llama+docs", "cp2"), ("tiny_qwen3", "fsdp2_cp2"), ("tiny_olmo2+docs", "cp2_tp2"),
]
TIMEOUT = 600


def _train(work, cases: list[tuple[str, str]]) -> dict[str, tuple]:
    """Each flavor's one-rank baseline and every ``(flavor, layout)`` of ``cases``, one
    launch per world size; ``"<flavor>/<layout>" -> (losses, config path)``."""
    flavors = dict.fromkeys(flavor for flavor, _ in cases)
    folders = {f.split("+")[0]: None for f in flavors}
    folders = {f: save_folder(f, work / f) for f in folders}
    base = {f: [*COMMON, f"model.hf={folders[f.split('+')[0]]}",
                *(o for v in f.split("+")[1:] for o in VARIANTS[v]), "parallelism=single"] for f in flavors}
    out: dict[str, tuple] = {}
    for world in sorted({LAYOUTS[layout][0] for _, layout in cases}):
        ranks = {}
        for flavor, layout in cases:
            if LAYOUTS[layout][0] == world:
                test = [*base[flavor][:-1], *LAYOUTS[layout][1]]
                ranks[f"{flavor}/{layout}"] = match_global_batch(base[flavor], test)[0]
        alone = {f"{f}/single": argv for f, argv in base.items()} if not out else {}
        out.update(train_in_one_launch(work / f"world{world}", world=world, alone=alone, ranks=ranks,
                                       timeout=TIMEOUT))
    return out


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("hf_parallel")


@pytest.fixture(scope="module")
def runs(work):
    return _train(work, DEFAULT)


@pytest.fixture(scope="module")
def more_runs(tmp_path_factory):
    return _train(tmp_path_factory.mktemp("hf_parallel_more"), EXTENDED)


def _first_batch(config_path):
    """The ids of one rank's first step, rebuilt from its resolved config."""
    from omegaconf import OmegaConf

    from titan_plugins.data import build_dataloader, build_tokenizer
    from titan_plugins.plugins import get_plugin_manager

    job = OmegaConf.load(config_path)
    data = job.data
    loader = build_dataloader(data, build_tokenizer(data), dp_rank=0, dp_world=1,
                              local_batch_size=int(job.training.local_batch_size),
                              seq_len=int(job.training.seq_len), seed=int(job.training.seed),
                              datasets=get_plugin_manager().datasets(),
                              grad_accum_steps=int(job.training.grad_accum_steps))
    batch = next(iter(loader))
    return batch[0], batch[1]


def _assert_equals_one_rank(out, flavor: str, layout: str) -> None:
    base, got = out[f"{flavor}/single"][0], out[f"{flavor}/{layout}"][0]
    assert len(base) == len(got) == STEPS, (base, got)
    assert max(abs(a - b) for a, b in zip(base, got, strict=True)) <= 1e-5, (flavor, layout, base, got)
    assert base[0] != base[-1]  # it trained


@pytest.mark.slow
def test_step1_loss_equals_transformers(runs, work):
    losses, config = runs["tiny_gemma3/single"]
    inputs, labels = _first_batch(config)
    ref = reference_model(work / "tiny_gemma3")
    with torch.no_grad():
        logits = ref(inputs).logits
    want = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100)
    assert abs(losses[0] - float(want)) <= 1e-5, (losses[0], float(want))


@pytest.mark.slow
@pytest.mark.parametrize("flavor, layout", DEFAULT)
def test_layout_equals_one_rank(runs, flavor, layout):
    _assert_equals_one_rank(runs, flavor, layout)


@pytest.mark.slow
@pytest.mark.extended
@pytest.mark.parametrize("flavor, layout", EXTENDED)
def test_more_layouts_equal_one_rank(more_runs, flavor, layout):
    _assert_equals_one_rank(more_runs, flavor, layout)


@pytest.mark.slow
@pytest.mark.extended
def test_tp_ranks_sample_the_same_experts(tmp_path):
    """PhiMoE samples its experts in training (transformers' default router_jitter_noise
    0.01) in an MoE block its TP plan leaves replicated: the tp ranks hold the same batch
    and must draw the same numbers, else their copies of the router and experts train
    apart, silently. Rank 0 alone probes the CPU's peak for MFU before the first step; the
    same tp2 job with the probe skipped (``metrics.peak_tflops`` set) trains the same losses."""
    import json

    from titan_hf.matrix_folders import tiny_folder

    folder = tiny_folder("phimoe", tmp_path / "phimoe")  # its noise off: turned back on here
    config = folder / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "router_jitter_noise": 0.01}))
    argv = [*COMMON, f"model.hf={folder}", "model.verify=false", *LAYOUTS["tp2_nosp"][1]]
    out = train_in_one_launch(tmp_path / "runs", world=2, timeout=TIMEOUT,
                              ranks={"probed": argv, "not_probed": [*argv, "metrics.peak_tflops=100"]})
    probed, not_probed = out["probed"][0], out["not_probed"][0]
    assert len(probed) == STEPS and max(abs(a - b) for a, b in zip(probed, not_probed, strict=True)) <= 1e-5, (
        probed, not_probed)


def _parallelized_on_a_fake_rank(flavor: str, par: dict):
    """``flavor`` built on meta and parallelized as rank 0 of ``par``'s world (fake group)."""
    from titan_hf.config import FLAVORS
    from titan_hf.model import build
    from titan_hf.parallelize import parallelize

    from titan_plugins.plan.fake_world import fake_world
    from titan_plugins.testing.model_parts import layout

    world = par.get("dp_shard", 1) * par.get("tp", 1)
    with fake_world(0, world):
        dims, job = layout(par)
        with torch.device("meta"):
            model = build(FLAVORS[flavor])
        return parallelize(model, dims, job), dims


def test_tp_without_fsdp_leaves_no_plain_parameter():
    """One fused AdamW call steps every parameter without FSDP and refuses a mix of
    DTensors and tensors: what the TP plan leaves (norms without SP, the MoE router) is
    replicated on tp."""
    from torch.distributed.tensor import DTensor, Replicate

    model, _ = _parallelized_on_a_fake_rank("tiny_mixtral", {"tp": 2, "sequence_parallel": False})
    plain = [n for n, p in model.named_parameters() if not isinstance(p, DTensor)]
    assert not plain, plain
    for name in ("layers.0.input_layernorm.weight", "layers.0.mlp.gate.weight", "norm.weight"):
        assert model.get_parameter(name).placements == (Replicate(),), name


def test_expert_parallel_places_whole_experts_on_each_rank():
    """transformers' base_model_ep_plan on ep2: each rank holds 2 of Mixtral's 4 experts
    (``Shard(0)`` on the ep mesh), and the experts module dispatches tokens to them."""
    from torch.distributed.tensor import DTensor, Shard

    model, _ = _parallelized_on_a_fake_rank("tiny_mixtral", {"dp_shard": 2, "ep": 2})
    experts = model.layers["1"].mlp.experts
    assert experts.num_experts == 2  # the local count the dispatcher and the experts' kernel read
    assert "forward" in vars(experts)  # transformers' dispatching forward, installed on the module
    for name in ("gate_up_proj", "down_proj"):
        p = experts.get_parameter(name)
        assert isinstance(p, DTensor) and p.shape[0] == 4, name
        # FSDP's expert_fsdp mesh (size 1 here) outside, whole experts over ep inside
        assert p.device_mesh.mesh_dim_names == ("expert_fsdp", "ep") and p.placements[-1] == Shard(0), name
        assert p.to_local().shape[0] == 2, name
