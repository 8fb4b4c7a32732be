"""The conformance kit on the GPT-2 example, plus what is particular to GPT-2."""

import pytest

from titan_plugins.testing import ConformanceSuite


class TestGPT2(ConformanceSuite):
    model_name = "gpt2"
    overrides = ["model.n_layers=2"]


def test_positions_are_learned_and_live_on_the_first_stage():
    torch = pytest.importorskip("torch")
    from titan_gpt2.config import FLAVORS
    from titan_gpt2.model import build

    with torch.device("meta"):
        model = build(FLAVORS["debugmodel"])
    assert model.pos_embeddings.weight.shape == (256, 64)
    assert not list(model.buffers())  # learned positions: nothing derived to rebuild
