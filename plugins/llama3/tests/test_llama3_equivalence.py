"""Same weights, bitwise the same logits, loss and gradients as TorchTitan 0.2.2's Llama 3."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from titan_plugins.testing.torchtitan_ref import import_torchtitan

try:
    import_torchtitan("torchtitan.models.llama3")
except ImportError as exc:  # torchtitan is a test-only dependency (pip install --no-deps)
    pytest.skip(f"torchtitan 0.2.2 not importable: {exc}", allow_module_level=True)

from llama3_reference import build_ours, build_reference  # noqa: E402
from titan_llama3.config import FLAVORS  # noqa: E402
from titan_llama3.state_dict_adapter import Llama3StateDictAdapter  # noqa: E402

SEQ, BATCH = 32, 2


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _step(model, tokens, labels):
    model.zero_grad(set_to_none=True)
    with sdpa_kernel(SDPBackend.MATH):
        logits = model(tokens)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
        loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return logits.detach(), loss.detach(), grads


def _compare(cfg):
    ref = build_reference(cfg, SEQ, seed=3)
    ours = build_ours(cfg, seed=3)
    # Same seed, same init scheme: the weights are equal before any loading.
    ref_sd = Llama3StateDictAdapter(cfg).from_torchtitan(ref.state_dict())
    ours_sd = ours.state_dict()
    assert sorted(ref_sd) == sorted(ours_sd)
    for name, value in ref_sd.items():
        assert torch.equal(ours_sd[name], value), name
    # the rotary cache too (TorchTitan's is as long as the training sequence)
    assert torch.equal(ours.freqs_cis[:SEQ], ref.freqs_cis)

    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, cfg.vocab_size, (BATCH, SEQ), generator=g)
    labels = torch.randint(0, cfg.vocab_size, (BATCH, SEQ), generator=g)
    ref_logits, ref_loss, ref_grads = _step(ref, tokens, labels)
    logits, loss, grads = _step(ours, tokens, labels)
    assert torch.equal(logits, ref_logits), (logits - ref_logits).abs().max()
    assert torch.equal(loss, ref_loss), (loss, ref_loss)
    assert sorted(grads) == sorted(ref_grads) == sorted(n for n, _ in ours.named_parameters())
    for name, grad in ref_grads.items():
        assert torch.equal(grads[name], grad), (name, (grads[name] - grad).abs().max())


def test_debugmodel_bitwise():
    # TorchTitan's debugmodel as it is: 6 layers, MHA 16 heads, dim 256, SwiGLU 768,
    # its default Llama 3.1 RoPE scaling.
    _compare(dataclasses.replace(FLAVORS["debugmodel"], max_seq_len=SEQ))


def test_gqa_ffn_multiplier_rope_factor_bitwise():
    # The released flavors' shape in small: GQA 8/2, ffn_dim_multiplier + multiple_of,
    # RoPE factor 32 (Llama 3.2), shallow init (depth_init off).
    cfg = dataclasses.replace(
        FLAVORS["debugmodel"], n_layers=2, n_heads=8, n_kv_heads=2, ffn_dim_multiplier=1.3,
        multiple_of=128, depth_init=False, max_seq_len=SEQ,
        rope_scaling=dataclasses.replace(FLAVORS["1B"].rope_scaling),
    )
    assert cfg.ffn_hidden_dim == 896 and cfg.rope_scaling.scaling_factor == 32.0
    _compare(cfg)
