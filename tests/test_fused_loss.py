"""The fused, chunked head + cross-entropy (titan_plugins/loss/fused.py) against
today's loss (whole logits, ``training.loss_chunk_size=0``): the same loss and the same
gradient of every parameter, on every first-party plugin (tiny), with label masks; and
on 2 gloo ranks under TP with loss parallel (+ sequence parallel), FSDP and PP."""

from __future__ import annotations

import pytest
import torch

from titan_plugins.errors import ConfigError
from titan_plugins.loss.fused import HeadRef, defer_head, head_ref, restore_head
from titan_plugins.loss.token_loss import IGNORE_INDEX, token_loss_sum, token_nll
from titan_plugins.model.lifecycle import build_meta_model
from titan_plugins.plugins import get_plugin_manager
from titan_plugins.train.api import prepare_job

TINY = {  # tiny shapes on each plugin's debug flavor: a few ms a forward
    "qwen3": ["model.n_layers=1"],
    "llama3": ["model.n_layers=1"],
    "llama4": ["model.n_layers=2"],
    "deepseek_v3": ["model.n_layers=2", "model.n_dense_layers=1"],
}


def _head_name(spec) -> str:
    return spec.pipeline.last_stage_modules[-1]


def _model(name: str):
    pm = get_plugin_manager()
    if name not in pm.models():
        pytest.skip(f"plugin for model {name!r} is not installed")
    spec, job, _ = prepare_job([f"model={name}", *TINY[name], "data.name=synthetic", "training.seq_len=16"], pm)
    model = build_meta_model(spec, job)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device("cpu"))
    return spec, model.train()


def _batch(vocab: int):
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, vocab, (2, 17), generator=gen)
    labels = tokens[:, 1:].clone()
    labels[0, :5] = IGNORE_INDEX  # a masked prompt
    labels[1, -3:] = IGNORE_INDEX  # padding
    return tokens[:, :-1], labels


def _loss_and_grads(model, inputs, labels, fn):
    model.zero_grad(set_to_none=True)
    out = fn(model(inputs), labels)
    out.sum().backward() if out.dim() else out.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.detach(), grads


def _assert_within_scale(got: torch.Tensor, want: torch.Tensor, key: str) -> None:
    """Within 1e-6 of the gradient's own scale (its largest entry), with 2x headroom.

    Chunking reorders two fp32 sums: the head's weight gradient is accumulated chunk by
    chunk over positions, and the hidden state's gradient comes from a matmul of another
    row count (another kernel blocking). A tied embedding (Qwen3's debug flavor) carries
    both into one tensor: measured 4-7e-6 on entries up to 6.9 (~1e-6 of its scale, ~14
    ulps), which an elementwise 1e-6 cannot hold however the threads are set."""
    scale = want.abs().max().item()
    err = (got - want).abs().max().item()
    assert err <= 2e-6 * max(scale, 1.0), f"{key}: max |diff| {err:.3g} at scale {scale:.3g}"


@pytest.mark.parametrize("name", list(TINY))
def test_fused_equals_whole_logits_on_every_plugin(name):
    spec, model = _model(name)
    head = getattr(model, _head_name(spec))
    inputs, labels = _batch(head.weight.shape[0])
    for fn in (token_loss_sum, token_nll):
        want, want_g = _loss_and_grads(model, inputs, labels, fn)
        assert defer_head(model, _head_name(spec), chunk_size=5, vocab_parallel=False)
        try:
            got, got_g = _loss_and_grads(model, inputs, labels, fn)
            assert head_ref(model(inputs)) is not None
        finally:
            restore_head(model, _head_name(spec))
        assert head_ref(model(inputs)) is None  # restored: logits again
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        assert sorted(got_g) == sorted(want_g)
        for key in want_g:
            _assert_within_scale(got_g[key], want_g[key], key)
        if fn is token_nll:
            assert (got[labels == IGNORE_INDEX] == 0).all()


def test_one_chunk_is_bitwise():
    """A chunk as large as the batch runs the very ops of the old path."""
    spec, model = _model("qwen3")
    inputs, labels = _batch(model.output.weight.shape[0])
    want, want_g = _loss_and_grads(model, inputs, labels, token_loss_sum)
    defer_head(model, _head_name(spec), chunk_size=inputs.numel(), vocab_parallel=False)
    got, got_g = _loss_and_grads(model, inputs, labels, token_loss_sum)
    assert torch.equal(got, want)
    assert all(torch.equal(got_g[k], want_g[k]) for k in want_g)


def test_no_grad_path_and_memory_of_the_logits():
    """Validation (no_grad) takes the chunked path too; under grad, the forward keeps no
    ``[positions, vocab]`` tensor alive: a trainable head keeps the gradients it computed
    in the forward (hidden states' ``[positions, dim]``, the head's ``[vocab, dim]``, which
    its ``.grad`` holds anyway), a frozen one only the hidden states'."""
    spec, model = _model("qwen3")
    vocab, dim = model.output.weight.shape
    inputs, labels = _batch(vocab)
    positions = labels.numel()
    defer_head(model, _head_name(spec), chunk_size=4, vocab_parallel=False)
    with torch.no_grad():
        want = token_loss_sum(model(inputs), labels)
    for trains_head in (True, False):
        model.output.weight.requires_grad_(trains_head)
        hidden = model(inputs)
        saved: list[torch.Size] = []  # what the loss's forward keeps for its backward
        with torch.autograd.graph.saved_tensors_hooks(lambda t, saved=saved: saved.append(t.shape) or t, lambda t: t):
            got = token_loss_sum(hidden, labels)
        torch.testing.assert_close(got.detach(), want, rtol=1e-6, atol=1e-6)
        allowed = {(positions, dim), (vocab, dim)} if trains_head else {(positions, dim)}
        assert saved and {tuple(s) for s in saved} <= allowed, saved  # no logits, no chunk of them
        got.backward()
        assert (model.output.weight.grad is not None) == trains_head
        model.zero_grad(set_to_none=True)


@pytest.mark.parametrize("fn", [token_loss_sum, token_nll], ids=["sum", "nll"])
def test_fused_equals_whole_logits_with_a_frozen_head(fn):
    """LoRA's case: the head (and the tied embedding) frozen; the gradients computed in
    the forward reach the rest of the model as the whole-logits path's do, for the
    summed loss and for the per-position one (preference objectives)."""
    spec, model = _model("qwen3")
    model.output.weight.requires_grad_(False)
    inputs, labels = _batch(model.output.weight.shape[0])
    want, want_g = _loss_and_grads(model, inputs, labels, fn)
    defer_head(model, _head_name(spec), chunk_size=5, vocab_parallel=False)
    weights = torch.rand(labels.shape, generator=torch.Generator().manual_seed(2))
    got, got_g = _loss_and_grads(model, inputs, labels, fn)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert sorted(got_g) == sorted(want_g) and "output.weight" not in got_g
    for key in want_g:
        _assert_within_scale(got_g[key], want_g[key], key)
    if fn is token_nll:  # a per-position upstream gradient (not all ones) reaches each row
        model.zero_grad(set_to_none=True)
        (fn(model(inputs), labels) * weights).sum().backward()
        got_w = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        restore_head(model, _head_name(spec))
        model.zero_grad(set_to_none=True)
        (fn(model(inputs), labels) * weights).sum().backward()
        for n, p in model.named_parameters():
            if p.grad is not None:
                _assert_within_scale(got_w[n], p.grad, n)


class _Softcapped(torch.nn.Module):
    """A model doing work after its head (as Gemma's logit soft-capping does)."""

    def __init__(self, declared: bool | None = None) -> None:
        super().__init__()
        self.output = torch.nn.Linear(4, 7, bias=False)
        if declared is not None:
            self.titan_fused_loss = declared

    def forward(self, x):
        return 30.0 * torch.tanh(self.output(x) / 30.0)


def test_work_after_the_head_is_declared_or_refused_in_one_line():
    assert not defer_head(_Softcapped(declared=False), "output", chunk_size=2, vocab_parallel=False)
    model = _Softcapped()
    assert defer_head(model, "output", chunk_size=2, vocab_parallel=False)
    with pytest.raises(ConfigError, match="does work after its head 'output'.*training.loss_chunk_size=0"):
        model(torch.randn(1, 3, 4))


def test_bias_and_dtype_follow_the_head():
    head = torch.nn.Linear(8, 11, bias=True)
    h = torch.randn(2, 3, 8, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, 11, (2, 3))
    ref = HeadRef(head.weight, head.bias, 2, False)
    from titan_plugins.loss.fused import chunked_ce

    got = chunked_ce(h, labels, ref, ignore_index=IGNORE_INDEX, reduction="sum")
    got_g = torch.autograd.grad(2.5 * got, (h, head.weight, head.bias))
    want = torch.nn.functional.cross_entropy(
        torch.nn.functional.linear(h, head.weight.bfloat16(), head.bias.bfloat16()).flatten(0, 1).float(),
        labels.flatten(), reduction="sum")
    want_g = torch.autograd.grad(2.5 * want, (h, head.weight, head.bias))
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    for g, w in zip(got_g, want_g):  # bf16 products: the head's and bias's sums run in fp32 here
        assert g.dtype == w.dtype
        torch.testing.assert_close(g, w, rtol=2e-2, atol=2e-2)


# ------------------------------------------------------------ 2 gloo ranks
LAYOUTS = {  # layout -> extra overrides; every one on the model of the one-process tests
    "tp2": ["parallelism.loss_parallel=true"],
    "tp2_noloss": ["parallelism.loss_parallel=false", "parallelism.sequence_parallel=false"],
    "fsdp2": [],
    "pp2": ["training.local_batch_size=2", "model.enable_weight_tying=false"],
}


def _parallel_rank(rank: int, world: int) -> dict:
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import loss_parallel

    from titan_plugins.distributed.parallel_dims import ParallelDims
    from titan_plugins.distributed.pipeline import stage_inputs
    from titan_plugins.loss.token_loss import GlobalTokenLoss
    from titan_plugins.model.lifecycle import build_model_parts

    pm = get_plugin_manager()
    out = {}
    for key, extra in LAYOUTS.items():
        layout = key.split("_")[0]
        spec, job, _ = prepare_job(["model=qwen3", "model.n_layers=2", "data.name=synthetic",
                                    "training.seq_len=16", f"parallelism={layout}", *extra], pm)
        dims = ParallelDims.from_config(job.parallelism, world)
        dims.build_meshes("cpu")
        inputs, labels = _batch(2048)
        results = []
        for fused in (False, True):
            loss_fn = GlobalTokenLoss()
            loss_fn.global_tokens = float((labels != IGNORE_INDEX).sum())
            torch.manual_seed(0)
            parts = build_model_parts(spec, job, dims, torch.device("cpu"), pm, loss_fn, fused_loss=fused)
            ctx = loss_parallel() if dims.tp_enabled and job.parallelism.loss_parallel else torch.enable_grad()
            with ctx:
                if parts.pp:
                    losses: list[torch.Tensor] = []
                    extra_in = stage_inputs(parts.parts[0], spec.pipeline, inputs)
                    args = (inputs,) if parts.has_first else ()
                    parts.schedule.step(*args, target=labels, losses=losses, **extra_in)
                    loss = sum(float(x) for x in losses) if losses else 0.0
                else:
                    value = loss_fn(parts.parts[0](inputs), labels)
                    value.backward()
                    loss = float((value.full_tensor() if isinstance(value, DTensor) else value).detach())
            grads = {}
            for part in parts.parts:
                for n, p in part.named_parameters():
                    g = p.grad
                    grads[n] = (g.full_tensor() if isinstance(g, DTensor) else g).clone()
            deferred = sum(type(getattr(p, "output", None)).__name__.startswith("Deferred") for p in parts.parts)
            results.append((loss, grads, deferred))
        (l0, g0, d0), (l1, g1, d1) = results
        out[key] = {
            "loss": (l1, l0),
            "names": sorted(g0) == sorted(g1),
            "deferred": (d0, d1),  # the head of the part that holds it (PP: the last stage)
            "grad_diff": max(((g1[k] - g0[k]).abs().max().item() for k in g0), default=0.0),
            "grad_max": max((g0[k].abs().max().item() for k in g0), default=0.0),
        }
    return out


@pytest.mark.slow
def test_fused_equals_whole_logits_under_tp_loss_parallel_fsdp_and_pp():
    from titan_plugins.testing.gloo import run_ranks

    results = run_ranks(_parallel_rank, 2, timeout=300)
    for layout in LAYOUTS:
        # the fused build deferred the head on every rank that holds it (PP: the last stage only)
        held = [r[layout]["deferred"] for r in results]
        assert held == ([(0, 0), (0, 1)] if layout == "pp2" else [(0, 1), (0, 1)]), (layout, held)
    for result in results:
        for layout, r in result.items():
            got, want = r["loss"]
            assert got == pytest.approx(want, rel=1e-6, abs=1e-6), (layout, r)
            assert r["names"], layout
            assert r["grad_diff"] <= 1e-6 * max(1.0, r["grad_max"]), (layout, r)
