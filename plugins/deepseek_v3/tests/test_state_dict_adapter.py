"""TorchTitan and Hugging Face names: round trips and the name tables."""

from __future__ import annotations

import pytest
import torch
from titan_deepseek_v3.config import make_config
from titan_deepseek_v3.model import build
from titan_deepseek_v3.state_dict_adapter import DeepSeekV3StateDictAdapter

TINY = dict(vocab_size=64, dim=32, n_layers=3, n_dense_layers=1, n_heads=2, kv_lora_rank=16,
            qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, ffn__hidden_dim=48,
            moe__hidden_dim=16, num_experts=4, top_k=2, max_seq_len=16)


@pytest.mark.parametrize("q_lora_rank", [0, 12])
def test_round_trips(q_lora_rank):
    config = make_config(**TINY, q_lora_rank=q_lora_rank)
    torch.manual_seed(0)
    model = build(config)
    model.init_weights()
    sd = model.state_dict()
    adapter = DeepSeekV3StateDictAdapter(config)

    tt = adapter.to_torchtitan(sd)
    assert "output.weight" in tt and "lm_head.weight" not in tt
    assert adapter.from_torchtitan(tt).keys() == sd.keys()

    hf = adapter.to_hf(sd)
    assert "lm_head.weight" in hf and "model.embed_tokens.weight" in hf
    assert "model.layers.1.mlp.gate.e_score_correction_bias" in hf
    torch.testing.assert_close(hf["model.layers.2.mlp.experts.3.gate_proj.weight"], sd["layers.2.moe.experts.w1"][3])
    torch.testing.assert_close(hf["model.layers.2.mlp.experts.1.down_proj.weight"], sd["layers.2.moe.experts.w2"][1])
    q = "self_attn.q_proj.weight" if q_lora_rank == 0 else "self_attn.q_a_layernorm.weight"
    assert f"model.layers.0.{q}" in hf
    back = adapter.from_hf(hf)
    assert back.keys() == sd.keys()
    for key in sd:
        torch.testing.assert_close(back[key], sd[key], rtol=0, atol=0)
    model.load_state_dict(back, strict=True)


def test_from_hf_skips_the_mtp_layer_and_rejects_fp8():
    config = make_config(**TINY)
    adapter = DeepSeekV3StateDictAdapter(config)
    hf = adapter.to_hf(build(config).state_dict())
    extra = {**hf, "model.layers.3.self_attn.o_proj.weight": torch.zeros(1)}  # the MTP layer (61 in V3)
    assert adapter.from_hf(extra).keys() == adapter.from_hf(hf).keys()
    with pytest.raises(ValueError, match="dequantize"):
        adapter.from_hf({**hf, "model.layers.0.self_attn.o_proj.weight_scale_inv": torch.ones(1)})
    del hf["model.layers.1.mlp.experts.2.up_proj.weight"]
    with pytest.raises(KeyError, match="experts"):
        adapter.from_hf(hf)


def test_balancing_off_writes_a_zero_routing_bias_and_refuses_a_real_one():
    from titan_plugins.errors import ConfigError

    config = make_config(**TINY, load_balance_coeff=None)
    model = build(config)
    adapter = DeepSeekV3StateDictAdapter(config)
    hf = adapter.to_hf(model.state_dict())
    bias = "model.layers.1.mlp.gate.e_score_correction_bias"
    assert torch.equal(hf[bias], torch.zeros(4))  # transformers loads the folder strictly
    assert adapter.from_hf(hf).keys() == model.state_dict().keys()
    hf[bias] = torch.full((4,), 0.5)
    with pytest.raises(ConfigError, match="load_balance_coeff"):
        adapter.from_hf(hf)
