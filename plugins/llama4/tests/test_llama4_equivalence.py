"""Same weights, same logits, loss and gradients as TorchTitan 0.2.2's Llama 4."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from titan_plugins.testing import model_parts as mp

mp.require_torchtitan("torchtitan.models.llama4")  # or skip: a test-only dependency (pip install --no-deps)

from llama4_reference import build_reference, flavor_args, reference_forward  # noqa: E402
from titan_llama4.config import FLAVORS  # noqa: E402
from titan_llama4.model import build  # noqa: E402
from titan_llama4.state_dict_adapter import Llama4StateDictAdapter  # noqa: E402

SEQ, BATCH = 64, 2


@pytest.fixture(autouse=True)
def _cpu_reference(monkeypatch):
    mp.torchtitan_on_cpu(monkeypatch)


def _ours(flavor: str, **overrides):
    cfg = dataclasses.replace(FLAVORS[flavor], **overrides)
    with torch.device("meta"):
        model = build(cfg)
    model.to_empty(device="cpu")
    model.init_weights(buffer_device=torch.device("cpu"))
    return model


def _pair(flavor: str, seed: int = 0, kernel: str = "sdpa_mask", **overrides):
    ref = build_reference(flavor_args(flavor, **overrides), SEQ, seed, kernel)
    ours = _ours(flavor, **overrides)
    sd = Llama4StateDictAdapter(ours.config).from_torchtitan(ref.state_dict())
    ours.load_state_dict(sd, strict=True)
    return ref, ours


def _step(model, tokens, labels, forward):
    return mp.loss_and_grads(model, tokens, labels, forward, every_param=True)


def _tokens(config, seed):
    """Random ids with documents ending at ``eos_id`` in different places per row."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, config.eos_id, (BATCH, SEQ), generator=g)
    tokens[0, [9, 40]] = config.eos_id
    tokens[1, 23] = config.eos_id
    return tokens


def _compare(ref, ours, seed=1):
    g = torch.Generator().manual_seed(seed)
    tokens = _tokens(ours.config, seed)
    labels = torch.randint(0, ours.config.vocab_size, (BATCH, SEQ), generator=g)
    eos = ours.config.eos_id
    l_ref, loss_ref, g_ref = _step(ref, tokens, labels, lambda m, t: reference_forward(m, t, eos))
    l_ours, loss_ours, g_ours = _step(ours, tokens, labels, lambda m, t: m(t))
    assert g_ref.keys() == g_ours.keys()
    torch.testing.assert_close(l_ours, l_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(loss_ours, loss_ref, rtol=1e-6, atol=1e-6)
    worst = {}
    for name in g_ref:
        torch.testing.assert_close(g_ours[name], g_ref[name], rtol=1e-4, atol=1e-6, msg=name)
        worst[name] = (g_ours[name] - g_ref[name]).abs().max().item()
    return (l_ours - l_ref).abs().max().item(), max(worst.values())


def test_same_seed_same_init():
    """TorchTitan's init scheme and order: a seeded init gives identical weights."""
    ref = build_reference(flavor_args("debugmodel", n_layers=4), SEQ, seed=3)
    torch.manual_seed(3)
    ours = _ours("debugmodel", n_layers=4)
    ref_sd, our_sd = ref.state_dict(), ours.state_dict()
    assert ref_sd.keys() == our_sd.keys()
    for key in ref_sd:
        assert torch.equal(ref_sd[key], our_sd[key]), key
    assert "freqs_cis" not in our_sd
    assert torch.equal(ours.freqs_cis[:SEQ], ref.freqs_cis[:SEQ])


def test_debugmodel_equivalence():
    ref, ours = _pair("debugmodel", n_layers=4)
    assert [b.moe_enabled for b in ours.layers.values()] == [False, True, False, True]
    diff_logits, diff_grad = _compare(ref, ours)
    print(f"debugmodel: max |logits diff| {diff_logits:.2e}, max |grad diff| {diff_grad:.2e}")


@pytest.mark.parametrize("block", [256, 16], ids=["flavor_block256", "block16"])
def test_irope_equivalence(block):
    """All 6 layers of debugmodel_irope: layers 0 and 4 NoPE + causal, the others
    RoPE + chunked causal (a block of 16 makes the chunks bite at seq 64), all
    within documents (block_causal; the batch holds EOS tokens)."""
    ref, ours = _pair("debugmodel_irope", fixed_attn_block_size=block)
    chunks = [b.attention.inner_attention.chunk_size for b in ours.layers.values()]
    assert chunks == [None, block, block, block, None, block]
    diff_logits, diff_grad = _compare(ref, ours)
    print(
        f"irope block {block}: max |logits diff| {diff_logits:.2e}, max |grad diff| {diff_grad:.2e}"
    )


def test_irope_chunking_matters():
    """Guard against a vacuous irope test: block 16 changes the logits vs block 256."""
    _, a = _pair("debugmodel_irope", fixed_attn_block_size=16)
    b = _ours("debugmodel_irope")
    b.load_state_dict(a.state_dict())
    tokens = torch.randint(0, 2048, (1, SEQ), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (a(tokens) - b(tokens)).abs().max() > 1e-3


def test_irope_document_masking_matters():
    """Guard against a vacuous block_causal test: the EOS tokens change the logits
    after them, and only after them, against plain causal attention."""
    from titan_llama4.config import AttentionMask

    masked = _ours("debugmodel_irope", fixed_attn_block_size=16)
    causal = _ours("debugmodel_irope", fixed_attn_block_size=16, attn_mask=AttentionMask.causal)
    causal.load_state_dict(masked.state_dict())
    tokens = _tokens(masked.config, seed=0)
    with torch.no_grad():
        diff = (masked(tokens) - causal(tokens)).abs().amax(dim=-1)
    # row 1: EOS at 23. Before it only kernel rounding differs (is_causal vs a mask).
    assert diff[1, :24].max() < 1e-5, diff[1, :24].max()
    assert diff[1, 24:].min() > 1e-3, diff[1, 24:].min()


def test_irope_flex_forward_matches_torchtitan_flex():
    """Forward only (flex attention has no CPU backward): our flex path on
    TorchTitan's own BlockMask machinery vs theirs, documents included."""
    ref, ours = _pair("debugmodel_irope", kernel="flex", fixed_attn_block_size=16)
    for block in ours.layers.values():
        block.attention.inner_attention.backend = "flex"
    tokens = _tokens(ours.config, seed=2)
    with torch.no_grad():
        torch.testing.assert_close(
            ours(tokens), reference_forward(ref, tokens, ours.config.eos_id), rtol=1e-5, atol=1e-5
        )
