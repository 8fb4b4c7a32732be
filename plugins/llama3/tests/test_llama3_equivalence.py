"""Same weights, bitwise the same logits, loss and gradients as TorchTitan 0.2.2's Llama 3."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from titan_plugins.testing import model_parts as mp

mp.require_torchtitan("torchtitan.models.llama3")  # or skip: a test-only dependency (pip install --no-deps)

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


_step = mp.loss_and_grads  # (logits, loss, grads) under the math SDPA kernel


def _compare(cfg):
    ref = build_reference(cfg, SEQ, seed=3)
    ours = build_ours(cfg, seed=3)
    # Same seed, same init scheme: the weights are equal before any loading.
    mp.assert_same_tensors(ours.state_dict(), Llama3StateDictAdapter(cfg).from_torchtitan(ref.state_dict()))
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
