"""The kit's Hugging Face checks on the scaffold (``titan-plugins new``, a
``LlamaForCausalLM`` mapping): the good plugin passes both; a mistake made the same way
in both directions passes the self-consistency round trip and is caught by the
comparison with transformers; a one-way config mapping is a broken contract."""

from __future__ import annotations

from pathlib import Path

import pytest

from titan_plugins.cli.scaffold import scaffold
from titan_plugins.testing.conformance import (
    ContractError,
    Session,
    Target,
    check_hf_round_trip,
    check_hf_transformers,
)

pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def _plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str,
            edits: list[tuple[str, str, str]] = ()) -> Session:
    """The scaffold ``name``, with ``(file, old, new)`` text edits, registered uninstalled."""
    root, _ = scaffold(name, tmp_path / name)
    for file, old, new in edits:
        path = root / f"titan_{name}" / file
        text = path.read_text()
        assert old in text, f"the scaffold changed: {old!r} not in {file}"
        path.write_text(text.replace(old, new))
    monkeypatch.syspath_prepend(str(root))
    return Session.open(Target(name, overrides=("model.n_layers=2",), plugins=(f"titan_{name}.plugin",)))


def test_the_scaffold_passes_both_hf_checks(tmp_path, monkeypatch):
    session = _plugin(tmp_path, monkeypatch, "kithfgood")
    assert check_hf_round_trip(session) is None
    assert check_hf_transformers(session) is None


def test_w1_w3_swapped_both_ways_is_caught_against_transformers(tmp_path, monkeypatch):
    # gate_proj <-> up_proj in the one declaration: to_hf and from_hf swap alike
    swap = [("hf.py", '"model.layers.{L}.mlp.gate_proj.weight"', '"@UP@"'),
            ("hf.py", '"model.layers.{L}.mlp.up_proj.weight"', '"model.layers.{L}.mlp.gate_proj.weight"'),
            ("hf.py", '"@UP@"', '"model.layers.{L}.mlp.up_proj.weight"')]
    session = _plugin(tmp_path, monkeypatch, "kithfswap", swap)
    assert check_hf_round_trip(session) is None  # the round trip cannot see it
    with pytest.raises(ContractError) as info:
        check_hf_transformers(session)
    message = str(info.value)
    assert message.startswith("hf-transformers: LlamaForCausalLM loaded from a random transformers model "
                              "gives logits "), message
    assert "w1/w3" in message


def test_an_adapter_subclass_swapping_w1_w3_is_caught(tmp_path, monkeypatch):
    """The same mistake in a hand-written adapter (both directions) around the declaration.
    (The sharded load reads declared names through the declaration, so here the export
    direction is where the logits differ; either way the kit fails it.)"""
    session = _plugin(tmp_path, monkeypatch, "kithfsub")
    import titan_kithfsub.hf as hf

    pairs = [("gate_proj", "up_proj"), ("up_proj", "gate_proj")]  # w1 <-> w3

    def swapped(sd):
        out = {}
        for key, value in sd.items():
            for a, b in pairs:
                if a in key:
                    key = key.replace(a, b)
                    break
            out[key] = value
        return out

    class Swapped(hf.KithfsubStateDictAdapter):
        def to_hf(self, sd):
            return swapped(super().to_hf(sd))

        def from_hf(self, hf_sd):
            return super().from_hf(swapped(hf_sd))

    monkeypatch.setattr(hf, "KithfsubStateDictAdapter", Swapped)
    assert check_hf_round_trip(session) is None
    with pytest.raises(ContractError, match=r"^hf-transformers: .* gives logits [0-9.e-]+ from "):
        check_hf_transformers(session)


def test_a_field_transformers_ignores_is_caught(tmp_path, monkeypatch):
    # written and read under one wrong name: self-consistent, but LlamaConfig drops it
    edit = [("hf.py", 'Field("rms_norm_eps", "norm_eps", float)', 'Field("rms_norm_epsilon", "norm_eps", float)')]
    session = _plugin(tmp_path, monkeypatch, "kithfcfg", edit)
    assert check_hf_round_trip(session) is None
    with pytest.raises(ContractError) as info:
        check_hf_transformers(session)
    assert str(info.value).startswith(
        "hf-transformers: config_to_hf writes rms_norm_epsilon=1e-05, which transformers' LlamaConfig does "
        "not read: it is dropped (did you mean 'rms_norm_eps'?)"), str(info.value)


def test_a_value_transformers_reads_otherwise_is_caught(tmp_path, monkeypatch):
    edit = [("hf.py", '"rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta}',
             '"rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta}, '
             '"num_key_value_heads": str(config.n_kv_heads)')]
    session = _plugin(tmp_path, monkeypatch, "kithfval", edit)
    with pytest.raises(ContractError, match=r"^hf-transformers: (config_to_hf writes num_key_value_heads='2'|"
                                            r"transformers cannot read)"):
        check_hf_transformers(session)


def test_an_architecture_transformers_lacks_keeps_the_round_trip_only(tmp_path, monkeypatch):
    edit = [("hf.py", 'ARCHITECTURE = "LlamaForCausalLM"', 'ARCHITECTURE = "NoSuchModelForCausalLM"')]
    session = _plugin(tmp_path, monkeypatch, "kithfnone", edit)
    assert check_hf_round_trip(session) is None
    reason = check_hf_transformers(session)
    assert reason == (f"transformers {transformers.__version__} has no NoSuchModelForCausalLM: only "
                      "hf-round-trip (self-consistency) checks the mapping")


def test_a_one_way_config_mapping_is_a_broken_contract(tmp_path, monkeypatch):
    edit = [("plugin.py", '            config_from_hf="titan_kithfone.hf:config_from_hf",\n', "")]
    session = _plugin(tmp_path, monkeypatch, "kithfone", edit)
    with pytest.raises(ContractError, match=r"^hf-round-trip: model 'kithfone' maps config\.json one way "
                                            r"only \(config_to_hf\)\. Fix: set both"):
        check_hf_round_trip(session)
    assert check_hf_transformers(session).startswith("model 'kithfone' has no Hugging Face mapping")


def test_init_weights_that_raises_fails_init_weights_with_the_plugins_line(tmp_path, monkeypatch):
    """(The kit's own audit: the failure names the contract and the plugin's line, not a
    TypeError of the kit.)"""
    from titan_plugins.testing.conformance import check_init_weights

    edit = [("model.py", "        self.rope_cache = self._rope(buffer_device or self.rope_cache.device)\n",
             "        raise RuntimeError('no init')\n")]
    session = _plugin(tmp_path, monkeypatch, "kitraise", edit)
    with pytest.raises(ContractError, match=r"^init-weights: init_weights\(buffer_device\) after to_empty raised "
                                            r"RuntimeError: no init \(at titan_kitraise/model\.py:\d+\)"):
        check_init_weights(session)
