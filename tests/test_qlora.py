"""QLoRA (``peft=qlora``, titan_plugins/peft/qlora.py): LoRA over a frozen NF4 base,
checked on a tiny Qwen3 built by transformers from a config (``model.hf``). The
reference is LoRA over the *dequantized* base: QLoRA must be exactly that, and differ
from LoRA over the full-precision base by the quantization error alone."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("torchao")
transformers = pytest.importorskip("transformers")

from titan_plugins.config.hydra_glue import model_config  # noqa: E402
from titan_plugins.errors import ConfigError  # noqa: E402
from titan_plugins.hf.load import load_hf_weights  # noqa: E402
from titan_plugins.loss.token_loss import token_loss_sum  # noqa: E402
from titan_plugins.peft.lora import adapter_modules  # noqa: E402
from titan_plugins.peft.qlora import QLoRALinear, dequantized  # noqa: E402
from titan_plugins.plugins import get_plugin_manager  # noqa: E402
from titan_plugins.testing.model_parts import adapter_grads, one_process_model  # noqa: E402
from titan_plugins.train.api import prepare_job  # noqa: E402

DENSE = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=64, rope_theta=10000.0,
             tie_word_embeddings=False, eos_token_id=5)
TOKENS = torch.randint(0, 96, (2, 13), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return _random_folder(tmp_path_factory.mktemp("qlora") / "base", DENSE, std=0.2)


def _random_folder(path, config: dict, *, std: float):
    """A random Qwen3 folder (Gaussian weights of ``std``)."""
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**config))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, std)
    model.save_pretrained(path)
    return path


def _args(base, method, *extra):
    return ["model=qwen3", f"model.hf={base}", "model.attn_backend=sdpa", "data.name=synthetic",
            "data.vocab_size=96", "training.seq_len=12", f"peft={method}", *extra]


def _model(base, method, *extra):
    """One process, as a run builds it: meta, adapters, to_empty, init, quantize, model.hf."""
    pm = get_plugin_manager()
    spec, job, _ = prepare_job(_args(base, method, *extra), pm)
    model = one_process_model(spec, job, base)
    if method == "qlora":  # every adapted base weight is stored in NF4
        assert all(type(m.weight).__name__ == "NF4Tensor" for _, m in adapter_modules(model))
    gen = torch.Generator().manual_seed(3)  # as if trained a little: B non-zero, A and B get gradients
    with torch.no_grad():
        for _, module in adapter_modules(model):
            module.lora_B.weight.copy_(torch.randn(module.lora_B.weight.shape, generator=gen) * 0.1)
    return model.train()


def _loss_and_grads(model):
    loss = token_loss_sum(model(TOKENS[:, :-1]), TOKENS[:, 1:]) / TOKENS[:, 1:].numel()
    loss.backward()
    return loss.detach(), adapter_grads(model)


def test_qlora_is_lora_over_the_dequantized_base(base):
    qlora = _model(base, "qlora")
    lora = _model(base, "lora")
    hf = transformers.Qwen3ForCausalLM.from_pretrained(base).state_dict()
    errors = []
    for name, module in adapter_modules(qlora):
        assert isinstance(module, QLoRALinear) and type(module.weight).__name__ == "NF4Tensor", name
        assert "weight" not in module._parameters  # a frozen buffer: nothing for FSDP or AdamW
        full = lora.get_submodule(name).weight
        w = dequantized(module.weight)
        errors.append(((w - full).abs().mean() / full.abs().mean()).item())
        with torch.no_grad():
            full.copy_(w)  # the LoRA reference on the dequantized base
    assert hf  # model.hf really went through NF4's copy_: 4-bit, with the error of 4 bits
    assert 0.01 < max(errors) < 0.15, errors
    got, got_g = _loss_and_grads(qlora)
    want, want_g = _loss_and_grads(lora)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for key in want_g:
        torch.testing.assert_close(got_g[key], want_g[key], rtol=1e-4, atol=1e-6, msg=key)
    trainable = [n for n, p in qlora.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_" in n for n in trainable)


def test_qlora_state_dict_keys_are_loras(base):
    """Same keys as peft=lora: adapter-only checkpoints and the PEFT export read them unchanged."""
    assert list(_model(base, "qlora").state_dict()) == list(_model(base, "lora").state_dict())


def _build_waiting(base, *extra):
    """A one-rank build whose base is to be loaded (``model.hf`` / ``init_from``): the
    4-bit base weights still on meta, listed as pending."""
    from titan_plugins.model.lifecycle import apply_peft, build_meta_model, materialize
    from titan_plugins.peft.qlora import pending_base

    spec, job, _ = prepare_job(_args(base, "qlora", *extra), get_plugin_manager())
    model = build_meta_model(spec, job)
    apply_peft(model, spec, job)
    materialize(model, job, torch.device("cpu"), base_later=True)
    waiting = pending_base(model)
    assert sorted(waiting) == sorted(f"{n}.weight" for n, _ in adapter_modules(model))
    assert all(module.weight.is_meta for _, module in adapter_modules(model))  # never materialized whole
    assert not any(p.is_meta for p in model.parameters())  # everything else is
    return spec, job, model


def _assert_same_model(got, want):
    """Same 4-bit base (bitwise, dequantized) and every other base entry equal (``want``'s
    adapters were moved: ``_model``)."""
    from titan_plugins.peft.lora import is_adapter_key

    for name, module in adapter_modules(want):
        assert torch.equal(dequantized(got.get_submodule(name).weight), dequantized(module.weight)), name
    base_keys = {f"{n}.weight" for n, _ in adapter_modules(want)}
    mine = got.state_dict()
    for key, value in want.state_dict().items():
        if key not in base_keys and not is_adapter_key(key):
            assert torch.equal(mine[key], value), key


def test_model_hf_fills_the_waiting_base_as_a_whole_build_then_quantize_did(base):
    """The base waits on meta until model.hf reads it, one tensor at a time; the result
    equals quantizing the loaded full-precision weights (``round_trip_base``, the old order)."""
    from titan_plugins.peft.lora import is_adapter_key
    from titan_plugins.peft.qlora import pending_base, round_trip_base

    spec, job, model = _build_waiting(base)
    load_hf_weights([model], spec, model_config(job.model, spec), base, verbose=False)
    assert not pending_base(model)
    lora = _model(base, "lora")
    adapters = {k: v for k, v in lora.state_dict().items() if is_adapter_key(k)}
    old_order = round_trip_base(lora.state_dict(), adapters)
    for name, module in adapter_modules(model):
        assert torch.equal(dequantized(module.weight), old_order[f"{name}.weight"]), name


def test_init_from_fills_the_waiting_base_as_model_hf_does(base, tmp_path):
    """checkpoint.init_from (a DCP checkpoint of the full-precision base): each base weight
    read whole, quantized, placed; the model equals the model.hf one."""
    from titan_plugins.checkpoint.checkpointer import load_model_weights, save_model_weights
    from titan_plugins.peft.qlora import pending_base

    save_model_weights(_model(base, "none"), tmp_path / "seed")
    _, _, model = _build_waiting(base, f"checkpoint.init_from={tmp_path / 'seed'}")
    load_model_weights([model], tmp_path / "seed")
    assert not pending_base(model)
    _assert_same_model(model, _model(base, "qlora"))


def test_a_folder_without_a_base_weight_stops_in_one_line(base, tmp_path):
    """A 4-bit base weight has no initial value to keep: a folder without it stops the load
    (before any forward could meet a meta weight)."""
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "partial"
    folder.mkdir()
    for f in base.iterdir():
        if f.suffix != ".safetensors":
            (folder / f.name).write_bytes(f.read_bytes())
    weights = load_file(base / "model.safetensors")
    save_file({k: v for k, v in weights.items() if "layers.1.self_attn.q_proj" not in k}, folder / "model.safetensors")
    spec, job, model = _build_waiting(base)
    with pytest.raises(ConfigError, match=r"model.hf=.*: the checkpoint has no tensor 'model\.layers\.1\.self_attn\.q_proj\.weight'"):
        load_hf_weights([model], spec, model_config(job.model, spec), folder, verbose=False)


@pytest.mark.parametrize("layout", ["parallelism=pp2", "parallelism=fsdp2_tp2_ep2"])
def test_qlora_refuses_pp_and_ep_in_one_line(base, layout):
    args = _args(base, "qlora", layout, "training.local_batch_size=2")
    if "ep2" in layout:  # a MoE flavor of its own (the base folder is dense)
        args = ["model=qwen3", "model.flavor=debugmodel_moe", "data.name=synthetic", "training.seq_len=12",
                "peft=qlora", "peft.target_modules=[wq]", layout]
    with pytest.raises(ConfigError, match=r"peft.method=qlora: not with parallelism\.(pp|ep)=2"):
        prepare_job(args, get_plugin_manager())


# ------------------------------------------------------------ 2 gloo ranks
# Wide enough that FSDP shards most 4-bit weights (whole blocks of 256 scales per rank);
# k/v (one scale block) stay replicated, so both kinds run side by side.
WIDE = dict(DENSE, hidden_size=256, intermediate_size=512, head_dim=32)


@pytest.fixture(scope="module")
def wide_base(tmp_path_factory):
    return _random_folder(tmp_path_factory.mktemp("qlora") / "wide", WIDE, std=0.05)


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _nf4_local(weight):
    """``(NF4 tensor this rank stores, whether FSDP shards it)``."""
    local = getattr(weight, "_local_tensor", weight)
    return local, local is not weight


def _nf4_bytes(nf4) -> int:
    return sum(getattr(nf4, a).nbytes for a in ("quantized_data", "quantized_scalers", "quantization_factor"))


def _unsharded_weights(model) -> dict:
    """Every adapted base weight as the forward sees it (FSDP gathers, then dequantized)."""
    from torch.distributed.fsdp import FSDPModule

    blocks = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for block in blocks:
        block.unshard()
    out = {name: dequantized(module.weight).clone() for name, module in adapter_modules(model)}
    for block in blocks:
        block.reshard()
    return out


def _layout_rank(rank: int, world: int, base: str) -> dict:
    from titan_plugins.distributed.parallel_dims import ParallelDims
    from titan_plugins.model.lifecycle import build_model_parts

    pm = get_plugin_manager()
    ref = _model(base, "qlora", "parallelism=fsdp2")  # built whole, on this rank alone
    ref_weights = {name: dequantized(m.weight) for name, m in adapter_modules(ref)}
    ref_bytes = {name: _nf4_bytes(m.weight) for name, m in adapter_modules(ref)}
    want_loss, want = _loss_and_grads(ref)
    out = {}
    for layout in ("fsdp2", "tp2"):
        spec, job, _ = prepare_job(_args(base, "qlora", f"parallelism={layout}"), pm)
        dims = ParallelDims.from_config(job.parallelism, world)
        dims.build_meshes("cpu")
        torch.manual_seed(0)
        model = build_model_parts(spec, job, dims, torch.device("cpu"), pm).parts[0]
        load_hf_weights([model], spec, model_config(job.model, spec), base, verbose=False)
        stored = {name: _nf4_local(m.weight) for name, m in adapter_modules(model)}
        gathered = _unsharded_weights(model)
        gen = torch.Generator().manual_seed(3)
        with torch.no_grad():
            from titan_plugins.peft.lora import set_full

            for _, module in adapter_modules(model):
                shape = tuple(module.lora_B.weight.shape)
                set_full(module.lora_B.weight, torch.randn(shape, generator=gen) * 0.1)
        from torch.distributed.tensor.parallel import loss_parallel

        # FSDP: each rank its row, over the global token count (the gradients sum); TP: all rows
        rows = TOKENS[rank:rank + 1] if layout == "fsdp2" else TOKENS
        with loss_parallel() if layout == "tp2" else torch.enable_grad():
            loss = token_loss_sum(model(rows[:, :-1]), rows[:, 1:]) / TOKENS[:, 1:].numel()
            loss.backward()
        loss = _full(loss).detach()
        if layout == "fsdp2":
            torch.distributed.all_reduce(loss)
        got = {}
        for name, module in adapter_modules(model):
            got[f"{name}.A"], got[f"{name}.B"] = _full(module.lora_A.weight.grad), _full(module.lora_B.weight.grad)
        out[layout] = {
            "loss": (loss.item(), want_loss.item()),
            "grad_diff": max((got[k] - want[k]).abs().max().item() for k in want),
            "grad_max": max(want[k].abs().max().item() for k in want),
            "nf4": sum(type(local).__name__ == "NF4Tensor" for local, _ in stored.values()),
            "sharded": sum(sharded for _, sharded in stored.values()),
            "adapters": len(want),
            # bitwise the one-process 4-bit weights once gathered (one scale mean per tensor)
            "weights_equal": all(torch.equal(gathered[n], ref_weights[n]) for n in ref_weights),
            "bytes": sum(_nf4_bytes(local) for local, _ in stored.values()),
            "bytes_if_halved": sum(ref_bytes[n] // (2 if sharded else 1) for n, (_, sharded) in stored.items()),
            "bytes_one_process": sum(ref_bytes.values()),
        }
    return out


@pytest.mark.slow
def test_qlora_under_fsdp2_and_tp2_equals_one_process(wide_base):
    """Loss and every adapter gradient equal one process's (FSDP: a row per rank; TP: the
    batch on both). FSDP shards the 4-bit weights whose scale blocks split evenly (each
    rank stores half of those, the gathered weight bitwise one process's); TP replicates."""
    from titan_plugins.testing.gloo import run_ranks

    for result in run_ranks(_layout_rank, 2, str(wide_base), timeout=300):
        for layout, r in result.items():
            print(layout, {k: r[k] for k in ("sharded", "nf4", "bytes", "bytes_one_process")})
            got, want = r["loss"]
            assert got == pytest.approx(want, rel=1e-5, abs=1e-6), (layout, r)
            assert r["nf4"] * 2 == r["adapters"], (layout, r)
            assert r["grad_diff"] <= 1e-4 * max(1.0, r["grad_max"]), (layout, r)
            assert r["weights_equal"], (layout, r)
            assert r["bytes"] == r["bytes_if_halved"], (layout, r)
        fsdp, tp = result["fsdp2"], result["tp2"]
        assert 0 < fsdp["sharded"] < fsdp["nf4"] and tp["sharded"] == 0  # k/v (one scale block) replicated
        assert fsdp["bytes"] < 0.6 * fsdp["bytes_one_process"] and tp["bytes"] == tp["bytes_one_process"]


def test_merge_dequantizes_and_differs_from_the_full_base_by_the_quantization_error(base):
    """``merge_into`` on a live QLoRA state dict dequantizes; ``round_trip_base`` gives an
    offline merge from the full-precision base the same weights, bit for bit. Against the
    full base + adapter the merged model's logits differ by the 4-bit error alone."""
    from titan_plugins.peft.lora import is_adapter_key, merge_into
    from titan_plugins.peft.qlora import round_trip_base

    qlora, lora = _model(base, "qlora"), _model(base, "lora")
    scaling = 16.0 / 8
    live = qlora.state_dict()
    adapters = {k: v for k, v in live.items() if is_adapter_key(k)}
    merged = merge_into(live, adapters, scaling)
    offline = merge_into(round_trip_base(lora.state_dict(), adapters), adapters, scaling)
    assert all(torch.equal(merged[k], offline[k]) for k in merged) and sorted(merged) == sorted(offline)
    plain = _model(base, "none")
    plain.load_state_dict(merged)
    with torch.no_grad():
        got, want, qlogits = plain(TOKENS), lora(TOKENS), qlora(TOKENS)
    torch.testing.assert_close(got, qlogits, rtol=1e-4, atol=1e-4)  # merged = what QLoRA computed
    rel = ((got - want).norm() / want.norm()).item()
    print(f"merged QLoRA vs full base + adapter: relative logits error {rel:.4f}")
    assert 0.005 < rel < 0.3


@pytest.mark.slow
def test_a_qlora_run_exports_merged_as_it_trained_and_an_adapter_peft_loads(base, tmp_path):
    """titan-run peft=qlora (adapter-only checkpoints), then titan-export: ``--merge`` of the
    run folds the adapters into the 4-bit base the run trained over, bit for bit what the
    live merge (``checkpoint.export_hf``) wrote; ``--adapter`` is a PEFT folder peft loads
    on the full-precision base, computing LoRA over that base with the trained adapters."""
    import json

    import peft
    from safetensors.torch import load_file

    from titan_plugins.export.lora import export_adapter, export_merged
    from titan_plugins.export.source import find_checkpoint, read_dcp_model
    from titan_plugins.train.api import run

    run_dir = tmp_path / "run"
    steps = ["training.steps=2", "training.lr=1e-2", "training.warmup_steps=0", "training.local_batch_size=2",
             "metrics.tensorboard=false", "checkpoint=periodic", "checkpoint.interval=2", "checkpoint.export_hf=true"]
    result = run(_args(base, "qlora", *steps), run_dir=run_dir, timeout=600)
    assert result.ok, (result.error, result.stderr[-3000:])
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "step" in r] == [1, 2]
    _, ckpt = find_checkpoint(run_dir)
    saved = read_dcp_model(ckpt)
    assert saved and all(".lora_" in k for k in saved)  # adapter-only
    assert any(v.abs().sum() > 0 for k, v in saved.items() if k.endswith("lora_B.weight"))  # it trained

    merged = export_merged(run_dir, tmp_path / "merged")
    def weights(folder):
        return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}

    live, offline = weights(run_dir / "hf"), weights(merged)
    assert sorted(live) == sorted(offline)
    assert all(torch.equal(live[k], offline[k]) for k in live)  # the 4-bit base, as the run saw it

    adapter = export_adapter(run_dir, tmp_path / "adapter")
    theirs = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(base), adapter)
    lora = _model(base, "lora")  # LoRA over the full-precision base, with the run's adapters
    missing = lora.load_state_dict(saved, strict=False)
    assert not missing.unexpected_keys and not [k for k in missing.missing_keys if ".lora_" in k]
    with torch.no_grad():
        got, want = theirs.eval()(TOKENS).logits, lora.eval()(TOKENS)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
