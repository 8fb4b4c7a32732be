"""LoRA on grouped MoE experts (titan_plugins/peft/experts.py): per-expert A/B as grouped
tensors inside the grouped expert math, on Qwen3-MoE, DeepSeek-V3 and Llama 4 built from
tiny random transformers folders (``model.hf``); transformers and peft are the
references for the exports. Nothing is downloaded."""

from __future__ import annotations

import copy
import json
import shutil

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from omegaconf import OmegaConf  # noqa: E402
from torch import nn  # noqa: E402

from titan_plugins.components.moe.experts import GroupedExperts  # noqa: E402
from titan_plugins.data.tokenizer import ASSETS  # noqa: E402
from titan_plugins.errors import ConfigError  # noqa: E402
from titan_plugins.model.lifecycle import build_meta_model  # noqa: E402
from titan_plugins.peft.lora import adapter_modules, apply_lora, init_adapters, is_adapter_key  # noqa: E402
from titan_plugins.plugins import get_plugin_manager  # noqa: E402
from titan_plugins.testing.model_parts import one_process_model  # noqa: E402
from titan_plugins.train.api import prepare_job  # noqa: E402

VOCAB = 96
TOKENS = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
SYNTH = ["data.name=synthetic", f"data.vocab_size={VOCAB}", "training.seq_len=16"]
EXPERTS = ["peft=lora", "peft.target_modules=[experts]"]

# Tiny Hugging Face configs (as the plugins' own hf tests build them): every MoE layout.
QWEN3_MOE = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=64, rope_theta=10000.0,
    tie_word_embeddings=False, eos_token_id=5, moe_intermediate_size=24, num_experts=4, num_experts_per_tok=2,
    norm_topk_prob=True,
)
DEEPSEEK_V3 = dict(  # a dense first layer, shared experts, grouped routing with its bias
    vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, n_shared_experts=1,
    num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1, routed_scaling_factor=2.5,
    norm_topk_prob=True, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
    v_head_dim=8, max_position_embeddings=64, rms_norm_eps=1e-5,
)
LLAMA4 = dict(  # dense, MoE, dense, MoE + NoPE; experts fused in the folder
    vocab_size=VOCAB, hidden_size=32, intermediate_size=24, intermediate_size_mlp=48, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=2,
    interleave_moe_layer_step=2, attention_chunk_size=5, use_qk_norm=True, eos_token_id=5,
    tie_word_embeddings=False,
)
MODELS = {
    "qwen3": ("Qwen3MoeForCausalLM", "Qwen3MoeConfig", QWEN3_MOE),
    "deepseek_v3": ("DeepseekV3ForCausalLM", "DeepseekV3Config", DEEPSEEK_V3),
    "llama4": ("Llama4ForCausalLM", "Llama4TextConfig", LLAMA4),
}


# ----------------------------------------------------------------- the grouped math
def _experts_with_lora(use_grouped_mm: bool) -> nn.Module:
    torch.manual_seed(0)
    holder = nn.Module()
    holder.experts = GroupedExperts(dim=32, hidden_dim=16, num_experts=4, use_grouped_mm=use_grouped_mm)
    with torch.no_grad():
        for w in (holder.experts.w1, holder.experts.w2, holder.experts.w3):
            w.normal_(0.0, 0.2)
    lora = OmegaConf.create({"method": "lora", "rank": 4, "alpha": 8.0, "dropout": 0.0, "target_modules": ["experts"]})
    apply_lora(holder, lora)
    init_adapters(holder, 0)
    with torch.no_grad():  # as after some steps: B non-zero, so A gets a gradient too
        for _, pair in adapter_modules(holder):
            pair.lora_B.weight.normal_(0.0, 0.2)
    return holder.experts


def _merged_reference(experts: nn.Module, x: torch.Tensor, counts: list[int]) -> tuple[torch.Tensor, dict]:
    """Each expert as plain linears over its merged weight ``W_e + s B_e A_e`` (fresh leaf
    copies of A and B): the output and the gradients of A/B by autograd."""
    leaves = {name: (pair.lora_A.weight.detach().clone().requires_grad_(),
                     pair.lora_B.weight.detach().clone().requires_grad_(), pair.scaling)
              for name, pair in experts.lora.items()}
    outs, start = [], 0
    for e, n in enumerate(counts):
        w = {name: getattr(experts, name)[e] + s * b[e] @ a[e] for name, (a, b, s) in leaves.items()}
        x_e = x[start:start + n]
        start += n
        outs.append(F.linear(F.silu(F.linear(x_e, w["w1"])) * F.linear(x_e, w["w3"]), w["w2"]))
    out = torch.cat(outs)
    (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
    return out, {name: (a.grad, b.grad) for name, (a, b, _) in leaves.items()}


@pytest.mark.parametrize("use_grouped_mm", [True, False], ids=["grouped_mm", "loop"])
def test_adapter_gradients_equal_a_per_expert_reference(use_grouped_mm):
    """The low-rank path runs inside the grouped expert math (torch._grouped_mm or the
    per-expert loop) on each expert's rows, an empty expert included: output and every A/B
    gradient equal per-expert linears over merged weights."""
    experts = _experts_with_lora(use_grouped_mm)
    counts = [5, 0, 7, 4]
    x = torch.randn(sum(counts), 32, generator=torch.Generator().manual_seed(2))
    want, grads = _merged_reference(experts, x, counts)
    got = experts(x, torch.tensor(counts))
    # not got.sum(): grouped_mm's backward rejects a stride-0 upstream gradient
    (got * torch.linspace(-1, 1, got.numel()).view_as(got)).sum().backward()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for name, pair in experts.lora.items():
        a, b = grads[name]
        assert pair.lora_A.weight.grad.shape == (4, 4, pair.in_features)  # [E, r, in]
        assert pair.lora_B.weight.grad.shape == (4, pair.out_features, 4)  # [E, out, r]
        torch.testing.assert_close(pair.lora_A.weight.grad, a, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(pair.lora_B.weight.grad, b, rtol=1e-5, atol=1e-6)
        assert pair.lora_A.weight.grad[1].abs().sum() == 0 and pair.lora_A.weight.grad[0].abs().sum() > 0
    assert all(w.grad is None for w in (experts.w1, experts.w2, experts.w3))  # the base is frozen


# ----------------------------------------------------------------- targets
QWEN3_META = ["model=qwen3", "model.flavor=debugmodel_moe", "model.n_layers=2", "model.dim=64",
              "model.moe_inter_dim=32", "model.moe.num_experts=4", "model.moe.top_k=2",
              "model.moe.num_shared_experts=1", *SYNTH]


@pytest.fixture(scope="module")
def meta_moe():
    spec, job, _ = prepare_job(QWEN3_META, get_plugin_manager())
    return build_meta_model(spec, job)


def _adapted(meta_moe, *targets, method="lora"):
    model = copy.deepcopy(meta_moe)
    cfg = {"method": method, "rank": 8, "alpha": 16.0, "dropout": 0.0, "target_modules": list(targets)}
    return apply_lora(model, OmegaConf.create(cfg), ("tok_embeddings", "norm", "output")), model


def test_experts_are_opted_into_by_name(meta_moe):
    """``experts`` (the module) adapts w1/w2/w3 of every layer, ``experts.w2`` one weight;
    all-linear leaves the experts out; QLoRA (its 4-bit base holds nn.Linear only) and a
    pattern that matches nothing are one line each."""
    names, model = _adapted(meta_moe, "experts")
    assert names == [f"layers.{i}.moe.experts.{w}" for i in range(2) for w in ("w1", "w2", "w3")]
    assert sorted(n for n, p in model.named_parameters() if p.requires_grad) == sorted(
        f"{n.rsplit('.', 1)[0]}.lora.{n.rsplit('.', 1)[1]}.lora_{x}.weight" for n in names for x in "AB")
    names, _ = _adapted(meta_moe, "wq", "layers.1.moe.experts.w2")
    assert names == ["layers.0.attention.wq", "layers.1.attention.wq", "layers.1.moe.experts.w2"]
    names, _ = _adapted(meta_moe, "all-linear")
    assert names and not [n for n in names if ".experts." in n]
    with pytest.raises(ConfigError, match=r"peft.method=qlora: .* grouped MoE expert weights layers.0.moe.experts.w1"
                                          r".*use peft=lora for them$") as err:
        _adapted(meta_moe, "experts", method="qlora")
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match=r"=expert: matches no module; nn.Linear modules here: .*; grouped expert "
                                          r"weights: layers.\*.moe.experts.w1, layers.\*.moe.experts.w2"):
        _adapted(meta_moe, "expert")


def test_a_frozen_router_keeps_its_load_balancing_bias(meta_moe):
    """Under LoRA the router is frozen base: no load-balancing hook moves its bias (an
    adapter-only checkpoint and the exports then hold all the run changed)."""
    from titan_plugins.components.moe import build_load_balance_hooks

    assert meta_moe.layers["0"].moe.load_balance_coeff is not None
    assert len(build_load_balance_hooks([copy.deepcopy(meta_moe)], None)) == 1
    _, adapted = _adapted(meta_moe, "experts")
    assert build_load_balance_hooks([adapted], None) == []


# ----------------------------------------------------------------- models from folders
def _hf_folder(path, name):
    arch, config_cls, kwargs = MODELS[name]
    torch.manual_seed(0)
    model = getattr(transformers, arch)(getattr(transformers, config_cls)(**kwargs))
    with torch.no_grad():  # random, so every weight and the routing bias matter
        for p in model.parameters():
            p.normal_(0.0, 0.2)
        for key, buf in model.named_buffers():
            if key.endswith("e_score_correction_bias"):
                buf.normal_(0.0, 0.2)
    model.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):  # a run reads the folder's tokenizer
        shutil.copyfile(ASSETS / "chat_tokenizer" / name, path / name)
    return path


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_experts")
    return {name: _hf_folder(root / name, name) for name in MODELS}


def _ours(name, folder, *extra, seed=0):
    """Our model as a one-rank run builds it from the folder (flex attention has no CPU
    backward: Qwen3 takes SDPA)."""
    sdpa = ["model.attn_backend=sdpa"] if name == "qwen3" else []
    spec, job, _ = prepare_job([f"model={name}", f"model.hf={folder}", *sdpa, *SYNTH, *extra], get_plugin_manager())
    return spec, job, one_process_model(spec, job, str(folder), seed=seed).eval()


def _loss(model, tokens=TOKENS):
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())


def _train(model, steps=3):
    """A few AdamW steps on the adapters (lr 1e-2): the losses."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-2)
    model.train()
    losses = []
    for _ in range(steps):
        loss = _loss(model)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return model.eval(), losses


@pytest.fixture(scope="module")
def trained(folders):
    """Each model with LoRA on its experts, 3 steps trained (and its plain base)."""
    out = {}
    for name, folder in folders.items():
        spec, job, model = _ours(name, folder, *EXPERTS)
        _, _, plain = _ours(name, folder)
        with torch.no_grad():
            step0 = model(TOKENS)
            base_logits = plain(TOKENS)
        base = {k: v.clone() for k, v in model.state_dict().items() if not is_adapter_key(k)}
        model, losses = _train(model)
        out[name] = dict(spec=spec, job=job, model=model, plain=plain, step0=step0, base_logits=base_logits,
                         base=base, losses=losses)
    return out


@pytest.mark.parametrize("name", list(MODELS))
def test_step0_is_the_base_bitwise_and_only_the_expert_adapters_train(trained, name):
    """B = 0: the adapted model's logits are the base's bit for bit; then only the expert
    adapters change (the base, the routing bias included, stays bitwise) and the loss falls."""
    run = trained[name]
    model = run["model"]
    assert torch.equal(run["step0"], run["base_logits"])
    pairs = dict(adapter_modules(model))
    assert pairs and all(".moe.experts.lora.w" in n for n in pairs)
    for pair in pairs.values():
        e = pair.num_experts
        assert pair.lora_A.weight.shape == (e, 8, pair.in_features) and pair.lora_B.weight.shape[::2] == (e, 8)
        assert pair.lora_B.weight.abs().sum() > 0 and pair.lora_A.weight.dtype == torch.float32
    after = {k: v for k, v in model.state_dict().items() if not is_adapter_key(k)}
    assert all(torch.equal(after[k], v) for k, v in run["base"].items())
    losses = run["losses"]
    assert losses[-1] < losses[0], losses


# ----------------------------------------------------------------- exports
def _run_dir(tmp_path, run):
    """A LoRA run directory by hand: config.yaml and an adapter-only DCP checkpoint of
    the trained model (what the trainer saves)."""
    import torch.distributed.checkpoint as dcp

    run_dir = tmp_path / "run"
    adapters = {k: v.clone() for k, v in run["model"].state_dict().items() if is_adapter_key(k)}
    dcp.save({"model": adapters}, checkpoint_id=str(run_dir / "checkpoints" / "step-3"))
    OmegaConf.save(run["job"], run_dir / "config.yaml")
    return run_dir


def _hf_logits(folder):
    model, info = transformers.AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
    assert not any(info.values()), info  # strict: nothing missing or unexpected
    with torch.no_grad():
        return model.eval()(TOKENS).logits


def _peft_logits(base, adapter):
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(base), adapter)
    # (peft 0.21 also warns that its own rank_pattern for the fused gate_up_proj matched nothing,
    # though it applies it: the logits below would differ otherwise)
    missing = [str(w.message) for w in caught if any(k in str(w.message).lower() for k in ("missing", "unexpected"))]
    assert not missing, missing
    with torch.no_grad():
        return model.eval()(TOKENS).logits


@pytest.mark.parametrize("name", ["qwen3", "deepseek_v3"])
def test_merged_and_peft_adapter_exports_give_the_trained_logits(folders, trained, tmp_path, name):
    """--merge folds every expert's B A into its weight (transformers loads the folder
    strictly); --adapter writes one LoRA pair per expert linear, which peft converts to
    transformers 5's fused experts: both give the trained model's logits. The adapter
    folder loads back into a run (peft.init_from)."""
    from titan_plugins.config.hydra_glue import model_config
    from titan_plugins.export.lora import export_adapter, export_merged
    from titan_plugins.peft.checkpoint import load_adapter_folder

    run = trained[name]
    with torch.no_grad():
        want = run["model"](TOKENS)
    assert (want - run["base_logits"]).abs().max().item() > 1e-2  # the adapters changed the model
    run_dir = _run_dir(tmp_path, run)
    merged = export_merged(run_dir, tmp_path / "merged")
    assert (_hf_logits(merged) - want).abs().max().item() <= 1e-5
    adapter = export_adapter(run_dir, tmp_path / "adapter")
    meta = json.loads((adapter / "adapter_config.json").read_text())
    assert "model.layers.1.mlp.experts.3.gate_proj" in meta["target_modules"]
    assert (_peft_logits(folders[name], adapter) - want).abs().max().item() <= 1e-5
    spec, job, fresh = _ours(name, folders[name], *EXPERTS, f"peft.init_from={adapter}", seed=5)
    load_adapter_folder([fresh], spec, model_config(job.model, spec), job)
    with torch.no_grad():
        assert (fresh(TOKENS) - want).abs().max().item() <= 1e-6


def test_llama4_adapter_export_is_one_line_and_merge_gives_the_trained_logits(trained, tmp_path, capsys):
    """Llama 4's folder keeps its experts fused (gate_up_proj, transposed): no per-expert
    linears, so no PEFT layout: --adapter is one line pointing to --merge, and --merge
    gives the trained model's logits; checkpoint.export_hf writes the merged folder alone
    and says why."""
    from titan_plugins.config.hydra_glue import model_config
    from titan_plugins.export.lora import export_adapter, export_lora_live, export_merged
    from titan_plugins.export.out_dir import export_kind

    run = trained["llama4"]
    run_dir = _run_dir(tmp_path, run)
    with pytest.raises(ConfigError, match=r"grouped experts layers.1.moe.experts.w1 have no per-expert linears in the "
                                          r"Hugging Face folder \(.*\), so a PEFT adapter has no layout for them: "
                                          r"export with --merge$") as err:
        export_adapter(run_dir, tmp_path / "adapter")
    assert "\n" not in str(err.value) and not (tmp_path / "adapter").exists()
    with torch.no_grad():
        want = run["model"](TOKENS)
    assert (_hf_logits(export_merged(run_dir, tmp_path / "merged")) - want).abs().max().item() <= 1e-5
    spec, job = run["spec"], run["job"]
    capsys.readouterr()
    live = export_lora_live(spec, model_config(job.model, spec), job, run["model"].state_dict(), run_dir / "hf",
                            run_dir)
    assert export_kind(live) == "merged" and not (run_dir / "hf-adapter").exists()
    said = capsys.readouterr().out.strip().splitlines()
    assert len(said) == 1 and said[0].startswith(f"checkpoint.export_hf=true: no {run_dir / 'hf-adapter'}: "), said
    assert (_hf_logits(live) - want).abs().max().item() <= 1e-5


def test_half_of_gate_up_is_refused_for_the_adapter_export(trained, tmp_path):
    """transformers 5 fuses each expert's gate and up projections: peft converts their
    adapters only as a pair, so w1 without w3 is one line for --adapter."""
    from titan_plugins.export.lora import export_adapter

    run = trained["qwen3"]
    spec, job, model = _ours("qwen3", run["job"].model.hf, "peft=lora", "peft.target_modules=[experts.w1,experts.w2]")
    run_dir = _run_dir(tmp_path, dict(run, job=job, model=model))
    with pytest.raises(ConfigError, match=r"adapts layers.0.moe.experts.w1 without layers.0.moe.experts.w3; .* "
                                          r"or export with --merge$"):
        export_adapter(run_dir, tmp_path / "adapter")


# ----------------------------------------- TP experts and EP (one launch, 2 gloo ranks)
LAYOUT_MODEL = [
    "model=qwen3", "model.flavor=debugmodel_moe", "model.n_layers=2", "model.dim=64", "model.n_heads=4",
    "model.n_kv_heads=2", "model.head_dim=16", "model.moe_inter_dim=32", "model.moe.num_experts=4",
    "model.moe.top_k=2", "model.moe.num_shared_experts=0", "model.vocab_size=96", "model.attn_backend=sdpa",
    *SYNTH, "peft=lora", "peft.target_modules=[experts,wq]",
]
LAYOUTS = ("fsdp2_ep2", "tp2_ep2", "tp2")  # EP (dp_shard ranks), EP borrowing TP ranks, TP experts


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _layout_rank(rank: int, world: int, layouts: tuple[str, ...] = LAYOUTS) -> dict:
    """Each layout on 2 ranks (the trainer's build_model_parts, the plugin's plan) against
    the same model on one process: the loss and every adapter gradient, expert adapters
    sharded like their experts."""
    from torch.distributed.tensor import DTensor, Shard

    from titan_plugins.testing.model_parts import adapter_grads, parallel_copy

    pm = get_plugin_manager()
    out = {}
    for layout in layouts:
        spec, job, _ = prepare_job([*LAYOUT_MODEL, f"parallelism={layout}"], pm)
        ref = one_process_model(spec, job)
        with torch.no_grad():  # as after some steps: B non-zero
            gen = torch.Generator().manual_seed(3)
            for _, pair in adapter_modules(ref):
                pair.lora_B.weight.copy_(torch.randn(pair.lora_B.weight.shape, generator=gen) * 0.1)
        model, dims = parallel_copy(spec, job, world, pm, ref)
        ref.train()
        model.train()
        want_loss = _loss(ref)
        want_loss.backward()
        want = adapter_grads(ref)
        # this rank's rows of the batch; the loss summed over them / all targets (FSDP sums gradients)
        rows = TOKENS.chunk(dims.dp_size)[dims.dp_rank()]
        logits = _full(model(rows[:, :-1]))
        loss = F.cross_entropy(logits.flatten(0, 1).float(), rows[:, 1:].flatten(), reduction="sum")
        (loss / TOKENS[:, 1:].numel()).backward()
        got = {k: _full(v) for k, v in adapter_grads(model).items()}
        experts = {n: p for n, p in model.named_parameters() if ".experts.lora." in n}
        out[layout] = {
            "loss": (loss.item(), want_loss.item() * TOKENS[:, 1:].numel() / dims.dp_size),
            "grad_diff": max((got[k] - want[k]).abs().max().item() for k in want),
            "grad_max": max(want[k].abs().max().item() for k in want),
            "expert_grad_min": min(want[k].abs().sum().item() for k in want if ".experts." in k),
            "same_names": sorted(got) == sorted(want),
            "dim0_sharded": sum(isinstance(p, DTensor) and Shard(0) in p.placements for p in experts.values()),
            "expert_adapters": len(experts),
            "frozen_ok": all(".lora_" in n for n, p in model.named_parameters() if p.requires_grad),
        }
    return out


@pytest.mark.slow
@pytest.mark.extended
def test_expert_adapters_under_ep_and_tp_equal_one_process():
    """fsdp2_ep2 (experts and their adapters Shard(0) on ep, FSDP over them), tp2_ep2 (EP
    borrowing the TP ranks) and tp2 (experts tensor-parallel: the adapter half whole over
    tp sums its gradient there): the loss and every adapter gradient equal one process's."""
    from titan_plugins.testing.gloo import run_ranks

    results = run_ranks(_layout_rank, 2, timeout=300)
    print({layout: (r["grad_diff"], r["grad_max"]) for layout, r in results[0].items()})
    for result in results:
        for layout, r in result.items():
            got, want = r["loss"]
            if layout != "fsdp2_ep2":  # dp ranks hold different rows: compare their sum below
                assert got == pytest.approx(want, rel=1e-5, abs=1e-6), (layout, r)
            assert r["same_names"] and r["frozen_ok"] and r["expert_grad_min"] > 0, (layout, r)
            assert r["grad_diff"] <= 1e-5 * max(1.0, r["grad_max"]), (layout, r)
            assert r["expert_adapters"] == 12 and (r["dim0_sharded"] == 12) is layout.endswith("ep2"), (layout, r)
    total = sum(result["fsdp2_ep2"]["loss"][0] for result in results)
    assert total == pytest.approx(results[0]["fsdp2_ep2"]["loss"][1] * 2, rel=1e-5)


# ----------------------------------------------------------------- runs (slow)
RUN = ["model.attn_backend=sdpa", *SYNTH, "training.steps=3", "training.lr=1e-2", "training.warmup_steps=0",
       "training.local_batch_size=4", "metrics.tensorboard=false", *EXPERTS, "checkpoint=periodic",
       "checkpoint.interval=3"]


def _train_run(folder, run_dir, *extra):
    from titan_plugins.train.api import run

    result = run(["model=qwen3", f"model.hf={folder}", *RUN, *extra], run_dir=run_dir, timeout=600)
    assert result.ok, (result.error, result.stderr[-3000:])
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "step" in r]


@pytest.mark.slow
@pytest.mark.extended
def test_ep2_run_equals_one_rank_and_its_exports_are_the_trained_model(folders, tmp_path):
    """A Qwen3-MoE run with LoRA on its experts, 3 steps: on 2 ranks with EP (fsdp2_ep2)
    loss and grad norm within 1e-5 (relative) of one rank's, the trained adapters within
    1e-5. The one-rank
    run's adapter-only checkpoint, checkpoint.export_hf (merged + PEFT adapter) and
    titan-export --merge all give the trained model's logits."""
    from titan_plugins.export.lora import export_merged
    from titan_plugins.export.source import find_checkpoint, read_dcp_model

    folder = folders["qwen3"]
    single = _train_run(folder, tmp_path / "one", "checkpoint.export_hf=true", "training.dump_final_params=true")
    multi = _train_run(folder, tmp_path / "ep2", "parallelism=fsdp2_ep2", "training.local_batch_size=2",
                       "training.dump_final_params=true")
    assert [r["step"] for r in single] == [1, 2, 3]  # random synthetic batches: no loss trend to check
    one, two = (torch.load(tmp_path / d / "final_params.pt") for d in ("one", "ep2"))
    experts = [k for k in one if ".experts.lora." in k]
    diffs = {key: max(abs(a[key] - b[key]) / abs(a[key]) for a, b in zip(single, multi, strict=True))
             for key in ("loss", "grad_norm")}
    diffs["adapters"] = max((one[k] - two[k]).abs().max().item() for k in experts)
    print("fsdp2_ep2 vs one rank:", diffs)
    assert diffs["loss"] <= 1e-5 and diffs["grad_norm"] <= 1e-5 and diffs["adapters"] <= 1e-5, diffs
    assert len(experts) == 12 and any(one[k].abs().sum() > 0 for k in experts if k.endswith("lora_B.weight"))

    _, ckpt = find_checkpoint(tmp_path / "one")
    saved = read_dcp_model(ckpt)
    assert saved and all(is_adapter_key(k) for k in saved)  # adapter-only, expert adapters in it
    spec, job, model = _ours("qwen3", folder, *EXPERTS)
    assert not model.load_state_dict(saved, strict=False).unexpected_keys
    with torch.no_grad():
        want = model(TOKENS)
    assert (_hf_logits(tmp_path / "one" / "hf") - want).abs().max().item() <= 1e-5
    assert (_peft_logits(folder, tmp_path / "one" / "hf-adapter") - want).abs().max().item() <= 1e-5
    assert (_hf_logits(export_merged(tmp_path / "one", tmp_path / "merged")) - want).abs().max().item() <= 1e-5
