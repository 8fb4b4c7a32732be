"""Attention masks and kernels: block-causal (SDPA boolean mask and flex BlockMask),
flex attention forward on CPU, and the backend choice."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from titan_qwen3.config import FLAVORS, AttentionBackend, AttentionMask
from titan_qwen3.model import build

from titan_plugins.components.attention import use_flex
from titan_plugins.components.attention_masks import document_ids

CFG = dataclasses.replace(FLAVORS["debugmodel"], n_layers=2, eos_id=7)


def _model(**overrides):
    torch.manual_seed(0)
    model = build(dataclasses.replace(CFG, **overrides))
    with torch.no_grad():
        model.init_weights()
    return model.eval()


def _tokens(seq=24, eos_at=(9,)):
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(8, CFG.vocab_size, (2, seq), generator=g)
    for i in eos_at:
        tokens[0, i] = 7
    return tokens


def test_document_ids():
    ids = document_ids(torch.tensor([[1, 7, 2, 3, 7, 4]]), eos_id=7)
    assert ids.tolist() == [[0, 0, 1, 1, 1, 2]]  # an EOS ends (belongs to) its document


def test_block_causal_sdpa_isolates_documents():
    model = _model(attn_mask=AttentionMask.block_causal, attn_backend=AttentionBackend.sdpa)
    causal = _model(attn_backend=AttentionBackend.sdpa)
    tokens = _tokens(eos_at=(9,))
    with torch.no_grad():
        out = model(tokens)
        # Row 0: the first document (0..9) sees nothing else -> plain causal on it;
        # the second (10..) attends only to itself; RoPE is relative, so it equals
        # the second document run on its own.
        torch.testing.assert_close(out[0, :10], causal(tokens[:1, :10])[0], rtol=0, atol=2e-5)
        torch.testing.assert_close(out[0, 10:], causal(tokens[:1, 10:])[0], rtol=0, atol=2e-5)
        # Row 1 has no EOS: block-causal is causal.
        torch.testing.assert_close(out[1], causal(tokens[1:])[0], rtol=0, atol=2e-5)
        assert (out[0, 10:] - causal(tokens[:1])[0, 10:]).abs().max() > 1e-3  # the mask matters


@pytest.mark.parametrize("mask", [AttentionMask.causal, AttentionMask.block_causal])
def test_flex_forward_matches_sdpa(mask):
    sdpa = _model(attn_mask=mask, attn_backend=AttentionBackend.sdpa)
    flex = _model(attn_mask=mask, attn_backend=AttentionBackend.flex)
    tokens = _tokens(seq=32, eos_at=(5, 20))
    with torch.no_grad():
        torch.testing.assert_close(flex(tokens), sdpa(tokens), rtol=0, atol=2e-5)


def test_backend_choice():
    assert not use_flex(AttentionBackend.auto, torch.device("cpu"))
    assert use_flex(AttentionBackend.auto, torch.device("cuda"))
    assert use_flex(AttentionBackend.flex, torch.device("cpu"))
    assert not use_flex(AttentionBackend.sdpa, torch.device("cuda"))


def test_flex_on_cpu_has_no_backward_and_validate_says_so():
    # If a future torch adds the CPU backward, this test tells us to enable it.
    from titan_qwen3.config import validate

    from titan_plugins.config.schema import ParallelismConfig
    from titan_plugins.errors import ConfigError

    model = _model(attn_backend=AttentionBackend.flex).train()
    with pytest.raises(NotImplementedError, match="backward on CPU"):
        model(_tokens()).sum().backward()
    with pytest.raises(ConfigError, match="flex attention has no CPU backward"):
        validate(dataclasses.replace(CFG, attn_backend=AttentionBackend.flex), ParallelismConfig(device="cpu"))
