"""The model and state-dict adapter Protocols (titan_plugins.protocols) describe what the
first-party plugins hand over, and reject what lacks a method."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from titan_plugins import HFStateDictAdapter, ModelProtocol, StateDictAdapter
from titan_plugins.generate.sampling import supports_generation
from titan_plugins.plugins import get_plugin_manager


@pytest.mark.parametrize("name", ["qwen3", "llama4", "deepseek_v3"])
def test_first_party_model_and_adapter_satisfy_the_protocols(name: str) -> None:
    pm = get_plugin_manager()
    if name not in pm.models():
        pytest.skip(f"{name} is not installed")
    spec = pm.get_model(name)
    config = spec.flavor("debugmodel")
    with torch.device("meta"):
        model = spec.load("build")(config)
    assert isinstance(model, ModelProtocol) and supports_generation(model)
    adapter = spec.load("state_dict_adapter")(config)
    assert isinstance(adapter, StateDictAdapter) and isinstance(adapter, HFStateDictAdapter)


def test_protocols_reject_missing_methods() -> None:
    class TorchTitanOnly:
        def to_torchtitan(self, sd):
            return sd

        def from_torchtitan(self, sd):
            return sd

    assert isinstance(TorchTitanOnly(), StateDictAdapter)
    assert not isinstance(TorchTitanOnly(), HFStateDictAdapter)
    assert not isinstance(torch.nn.Linear(2, 2), ModelProtocol)  # no init_weights


def test_protocols_import_without_torch() -> None:
    code = "import sys, titan_plugins.protocols; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
