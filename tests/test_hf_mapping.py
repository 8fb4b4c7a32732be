"""titan_plugins.hf.mapping: one declaration gives to_hf, from_hf and the sharded
load's read plan; every slice read through the plan equals the same slice of
``from_hf`` on whole tensors."""

from __future__ import annotations

import pytest
import torch

from titan_plugins.hf.mapping import (
    Absent,
    Fuse,
    HFMapping,
    MappedAdapter,
    Rename,
    RotaryPermute,
    Split,
    Stack,
    Tied,
    Transpose,
)


class Cfg:
    n_heads = 2
    tied = False
    experts = 3


MAPPING = HFMapping(
    Rename("emb.weight", "model.embed.weight"),
    Tied("out.weight", "emb.weight", when=lambda c: c.tied),
    Rename("out.weight", "lm_head.weight"),
    Rename("layers.{L}.wq.weight", "model.layers.{L}.q.weight", RotaryPermute("n_heads")),
    Rename("layers.{L}.wo.weight", "model.layers.{L}.o.weight", Transpose()),
    Stack("layers.{L}.experts.w2", "model.layers.{L}.experts.{E}.down.weight", count=lambda c: c.experts),
    Fuse("model.layers.{L}.experts.gate_up", ["layers.{L}.experts.w1", "layers.{L}.experts.w3"], dim=-1,
         transform=Transpose()),
    Fuse("model.layers.{L}.qkv.bias", ["layers.{L}.bq", "layers.{L}.bk", "layers.{L}.bv"], sizes=[4, 2, 2]),
    Split("layers.{L}.w13", ["model.layers.{L}.gate.weight", "model.layers.{L}.up.weight"], dim=0),
    Absent("layers.{L}.bias", default=lambda c: torch.zeros(c.experts), alongside="layers.{L}.experts.w2"),
    skip=[r".*\.cache"], ignore_hf=[r".*inv_freq"],
)


def ours() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    shapes = {"emb.weight": (6, 4), "out.weight": (6, 4), "layers.0.wq.weight": (8, 4),
              "layers.0.wo.weight": (4, 8), "layers.0.experts.w1": (3, 5, 4), "layers.0.experts.w3": (3, 5, 4),
              "layers.0.experts.w2": (3, 4, 5), "layers.0.bq": (4,), "layers.0.bk": (2,), "layers.0.bv": (2,),
              "layers.0.w13": (10, 4), "layers.0.bias": (3,)}
    sd = {k: torch.randn(s, generator=g) for k, s in shapes.items()}
    sd["layers.0.bias"] = torch.zeros(3)
    return sd


class Source:
    def __init__(self, hf: dict[str, torch.Tensor]):
        self.hf, self.whole = hf, []

    def read(self, key, index=None):
        if index is None:
            self.whole.append(key)
            return self.hf[key]
        return self.hf[key][index]

    def shape(self, key):
        return list(self.hf[key].shape)


def test_both_directions_from_one_declaration():
    sd, cfg = ours(), Cfg()
    hf = MAPPING.to_hf({**sd, "layers.0.cache": torch.ones(1)}, cfg)
    assert hf["model.layers.0.experts.gate_up"].shape == (3, 4, 10)
    assert torch.equal(hf["model.layers.0.experts.gate_up"][..., 5:], sd["layers.0.experts.w3"].transpose(1, 2))
    assert torch.equal(hf["model.layers.0.experts.1.down.weight"], sd["layers.0.experts.w2"][1])
    assert torch.equal(hf["model.layers.0.o.weight"], sd["layers.0.wo.weight"].t())
    assert torch.equal(hf["model.layers.0.up.weight"], sd["layers.0.w13"][5:])
    assert torch.equal(hf["model.layers.0.q.weight"][2], sd["layers.0.wq.weight"][1])  # pairs -> halves
    assert len(hf) == 11  # the absent bias and the skipped cache are not written
    back = MAPPING.from_hf({**hf, "model.rotary.inv_freq": torch.ones(1)}, cfg)
    assert sorted(back) == sorted(sd) and all(torch.equal(back[k], sd[k]) for k in sd)
    cfg.tied = True
    tied = MAPPING.to_hf(sd, cfg)
    assert "lm_head.weight" not in tied and MAPPING.from_hf(tied, cfg)["out.weight"] is tied["model.embed.weight"]


def test_mistakes_are_errors():
    sd, cfg = ours(), Cfg()
    with pytest.raises(KeyError, match="layers.0.experts.w3 is missing"):
        MAPPING.to_hf({"layers.0.experts.w1": sd["layers.0.experts.w1"]}, cfg)  # a fused part alone
    with pytest.raises(KeyError, match="no Hugging Face name for 'layers.0.nope'"):
        MAPPING.to_hf({"layers.0.nope": torch.ones(1)}, cfg)
    hf = MAPPING.to_hf(sd, cfg)
    with pytest.raises(KeyError, match="unknown Hugging Face entry 'model.extra'"):
        MAPPING.from_hf({**hf, "model.extra": torch.ones(1)}, cfg)
    del hf["model.layers.0.experts.2.down.weight"]
    with pytest.raises(KeyError, match=r"experts \[0, 1\] given, 0..2 expected"):
        MAPPING.from_hf(hf, cfg)


@pytest.mark.parametrize("index", [
    (slice(0, 4), slice(0, 4)), (slice(4, 8), slice(1, 3)),  # row / column shards
])
def test_load_reads_the_shards_slices(index):
    sd, cfg = ours(), Cfg()
    src = Source(MAPPING.to_hf(sd, cfg))
    for key in ("layers.0.wo.weight", "layers.0.w13", "layers.0.wq.weight"):
        idx = index[: sd[key].dim()]
        got, sliced = MAPPING.load(key, sd[key].shape, idx, src, cfg)
        assert torch.equal(got, sd[key][idx]), key
        assert sliced is (key != "layers.0.wq.weight")  # the rotary permutation is read whole
    assert src.whole == ["model.layers.0.q.weight"]
    for key in ("layers.0.experts.w1", "layers.0.experts.w3", "layers.0.experts.w2"):
        idx = (slice(1, 3), slice(1, 4), slice(0, 2))
        got, sliced = MAPPING.load(key, sd[key].shape, idx, src, cfg)
        assert sliced and torch.equal(got, sd[key][idx]), key
    for key in ("layers.0.bq", "layers.0.bk", "layers.0.bv"):  # unequal fused parts (declared sizes)
        got, sliced = MAPPING.load(key, sd[key].shape, (slice(1, 2),), src, cfg)
        assert sliced and torch.equal(got, sd[key][1:2]), key
    assert MAPPING.load("layers.0.bias", (3,), (slice(0, 3),), src, cfg) is None  # kept at init
    assert MAPPING.sources("layers.0.experts.w1", (3, 5, 4), cfg) == {"model.layers.0.experts.gate_up": (3, 4, 10)}


def test_check_against_a_checkpoint():
    sd, cfg = ours(), Cfg()
    hf = MAPPING.to_hf(sd, cfg)
    shapes = {k: v.shape for k, v in sd.items()}
    hf_shapes = {k: v.shape for k, v in hf.items()}
    assert MAPPING.check(hf_shapes, shapes, cfg) == []
    # w1 and w3 of a split both read from the gate: caught (one tensor twice, one never)
    slip = HFMapping(Rename("a.w1", "gate.weight"), Rename("a.w3", "gate.weight"))
    problems = slip.check({"gate.weight": (2, 2), "up.weight": (2, 2)}, {"a.w1": (2, 2), "a.w3": (2, 2)}, cfg)
    assert problems == ["gate.weight is mapped from both a.w1 and a.w3",
                        "up.weight is in the checkpoint but no entry of ours reads it"]
    problems = MAPPING.check({**hf_shapes, "model.layers.0.o.weight": (4, 8)}, shapes, cfg)
    assert problems == ["layers.0.wo.weight: model.layers.0.o.weight has shape (4, 8), the mapping expects (8, 4)"]


def test_adapter_and_prefix():
    class Adapter(MappedAdapter):
        mapping = MAPPING.with_prefix("language_model.")

    sd, cfg = ours(), Cfg()
    adapter = Adapter(cfg)
    hf = adapter.to_hf(sd)
    assert all(k.startswith("language_model.") for k in hf)
    assert sorted(adapter.from_hf(hf)) == sorted(sd)
    assert MAPPING.prefix == "" and "layers.0.cache" not in adapter.to_torchtitan({"layers.0.cache": 1})
