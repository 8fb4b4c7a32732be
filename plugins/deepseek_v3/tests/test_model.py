"""Model contract: buffers, pipeline-stage tolerance, compute dtype, YaRN switch."""

from __future__ import annotations

import copy

import pytest
import torch
from titan_deepseek_v3.config import make_config
from titan_deepseek_v3.model import build, precompute_freqs_cis

TINY = dict(
    vocab_size=64, dim=32, n_layers=3, n_dense_layers=1, n_heads=2, kv_lora_rank=16,
    qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, ffn__hidden_dim=48,
    moe__hidden_dim=16, num_experts=4, top_k=2, max_seq_len=16,
)


def materialize(config):
    with torch.device("meta"):
        model = build(config)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device("cpu"))
    return model


def test_freqs_cis_is_a_non_persistent_buffer_rebuilt_by_init_weights():
    config = make_config(**TINY)
    model = materialize(config)
    assert "freqs_cis" in dict(model.named_buffers())
    assert not any("freqs_cis" in k for k in model.state_dict())
    assert model.freqs_cis.dtype == torch.complex64 and model.freqs_cis.shape == (16, 2)
    torch.testing.assert_close(model.freqs_cis, precompute_freqs_cis(config), rtol=0, atol=0)
    # to_empty leaves garbage; init_weights rebuilds it, also on a deep copy (a PP stage).
    stage = copy.deepcopy(model)
    stage.to_empty(device="cpu")
    stage.init_weights()
    torch.testing.assert_close(stage.freqs_cis, model.freqs_cis, rtol=0, atol=0)
    assert not any("freqs_cis" in k for k in stage.state_dict())


def test_yarn_and_mscale_switch_on_past_original_seq_len():
    short = make_config(**TINY)
    long = make_config(**{**TINY, "original_seq_len": 8})
    assert not short.yarn_enabled and long.yarn_enabled
    assert short.softmax_scale == pytest.approx((8 + 4) ** -0.5)
    mscale = 0.1 * long.layer.rope.mscale * torch.log(torch.tensor(40.0)).item() + 1.0
    assert long.softmax_scale == pytest.approx((8 + 4) ** -0.5 * mscale**2)
    # YaRN scales the low frequencies only: the first (fastest) rotation is unchanged.
    a, b = precompute_freqs_cis(short), precompute_freqs_cis(long)
    torch.testing.assert_close(a[:, 0], b[:, 0])
    assert not torch.allclose(a[:, -1], b[:, -1])


def test_stage_without_embedding_or_output_runs_on_hidden_states():
    config = make_config(**TINY)
    model = materialize(config)
    tokens = torch.randint(0, 64, (2, 16))
    logits = model(tokens)
    first, last = copy.deepcopy(model), copy.deepcopy(model)
    del first.layers["2"]
    first.norm = None
    first.lm_head = None
    for key in ("0", "1"):
        del last.layers[key]
    last.tok_embeddings = None
    hidden = first(tokens)
    assert hidden.shape == (2, 16, 32)
    torch.testing.assert_close(last(hidden), logits)
    for stage in (first, last):  # init tolerates the missing modules
        stage.init_weights()


def test_compute_dtype_keeps_parameter_dtypes():
    model = materialize(make_config(**TINY))
    tokens = torch.randint(0, 64, (2, 16))
    fp32 = model(tokens)
    model.set_compute_dtype(torch.bfloat16)
    bf16 = model(tokens)
    assert bf16.dtype == torch.bfloat16
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert model.layers["1"].moe.experts.compute_dtype == torch.bfloat16
    bf16.float().sum().backward()
    assert all(p.grad is None or p.grad.dtype == torch.float32 for p in model.parameters())
    assert (bf16.float() - fp32).abs().max() < 0.1
    model.set_compute_dtype(None)
    torch.testing.assert_close(model(tokens), fp32)


def test_sequence_longer_than_max_seq_len_is_an_error():
    model = materialize(make_config(**TINY))
    with pytest.raises(ValueError, match="max_seq_len=16"):
        model(torch.randint(0, 64, (1, 17)))


def test_output_keeps_torchtitan_name_as_alias():
    model = materialize(make_config(**TINY))
    assert model.output is model.lm_head
    assert "lm_head.weight" in model.state_dict() and "output.weight" not in model.state_dict()
