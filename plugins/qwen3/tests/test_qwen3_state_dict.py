"""State-dict adapter: TorchTitan names are ours; Hugging Face names match
TorchTitan 0.2.2's own Qwen3 adapter, and a round trip is the identity."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from titan_qwen3.config import FLAVORS
from titan_qwen3.model import build
from titan_qwen3.state_dict_adapter import Qwen3StateDictAdapter

TINY_MOE = dataclasses.replace(
    FLAVORS["debugmodel_moe"], n_layers=2, moe=dataclasses.replace(FLAVORS["debugmodel_moe"].moe, num_experts=4, top_k=2)
)


def _model(cfg):
    torch.manual_seed(0)
    model = build(cfg)
    with torch.no_grad():
        model.init_weights()
    return model


@pytest.mark.parametrize("cfg", [dataclasses.replace(FLAVORS["debugmodel"], n_layers=2), TINY_MOE],
                         ids=["dense_tied", "moe"])
def test_hf_round_trip(cfg):
    model = _model(cfg)
    adapter = Qwen3StateDictAdapter(cfg)
    sd = model.state_dict()
    assert "rope_cache" not in sd
    hf = adapter.to_hf(sd)
    if cfg.enable_weight_tying:
        assert "lm_head.weight" not in hf
    if cfg.moe_enabled:
        w = hf["model.layers.1.mlp.experts.3.gate_proj.weight"]
        assert w.shape == (cfg.moe_inter_dim, cfg.dim)
        assert torch.equal(w, sd["layers.1.moe.experts.w1"][3])
        assert hf["model.layers.0.mlp.experts.0.down_proj.weight"].shape == (cfg.dim, cfg.moe_inter_dim)
    back = adapter.from_hf(hf)
    assert sorted(back) == sorted(sd)
    for key, value in sd.items():
        assert torch.equal(back[key], value), key
    # loads strictly into a fresh model
    _model(cfg).load_state_dict(back, strict=True)


@pytest.mark.parametrize("cfg", [dataclasses.replace(FLAVORS["debugmodel"], n_layers=2), TINY_MOE],
                         ids=["dense_tied", "moe"])
def test_hf_names_match_torchtitan_adapter(cfg):
    from titan_plugins.testing.torchtitan_ref import import_torchtitan

    try:
        tt = import_torchtitan("torchtitan.models.qwen3")
    except ImportError as exc:
        pytest.skip(f"torchtitan 0.2.2 not importable: {exc}")
    from qwen3_reference import reference_args

    sd = _model(cfg).state_dict()
    ours = Qwen3StateDictAdapter(cfg).to_hf(sd)
    theirs = tt.Qwen3StateDictAdapter(reference_args(cfg), None).to_hf(dict(sd))
    assert sorted(ours) == sorted(theirs)
    for key, value in theirs.items():
        assert torch.equal(ours[key], value), key


def test_torchtitan_names_are_ours():
    cfg = TINY_MOE
    sd = _model(cfg).state_dict()
    adapter = Qwen3StateDictAdapter(cfg)
    assert adapter.from_torchtitan(adapter.to_torchtitan(sd)).keys() == sd.keys()
    assert "layers.0.moe.expert_bias" in sd and "layers.0.moe.router.gate.weight" in sd
