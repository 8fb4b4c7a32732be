"""Llama 3 from a Hugging Face folder (``model.hf``): config.json mapping, strict weight
load through the adapter (q/k rows permuted between the rotary layouts), logits equal
to transformers' ``LlamaForCausalLM`` in fp32, and back out through the exporter.

The folders are tiny random models built by transformers from configs shaped like the
released ones (written with ``save_pretrained``; nothing is downloaded)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from llama3_hf_folders import KINDS, SYNTH, hf_folder  # noqa: E402
from titan_llama3.hf_config import config_from_hf, config_to_hf  # noqa: E402

from titan_plugins.errors import ConfigError  # noqa: E402
from titan_plugins.plugins import get_plugin_manager  # noqa: E402
from titan_plugins.testing.model_parts import hf_model  # noqa: E402
from titan_plugins.train.api import prepare_job  # noqa: E402


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """One saved folder (and its transformers model) per kind, shared by the module's tests:
    they only read them (a test that edits config.json works on a copy)."""
    root = tmp_path_factory.mktemp("llama3_hf")
    return {kind: hf_folder(root, kind) for kind in KINDS}


def edited_copy(folders, tmp_path, kind: str, **fields):
    """A copy of a shared folder with config.json fields set."""
    folder = tmp_path / kind
    shutil.copytree(folders[kind][0], folder)
    data = json.loads((folder / "config.json").read_text())
    data.update(fields)
    (folder / "config.json").write_text(json.dumps(data))
    return folder


def load_ours(folder, *overrides):
    return hf_model("llama3", folder, *SYNTH, "training.seq_len=16", *overrides)


@pytest.mark.parametrize("kind", list(KINDS))
def test_logits_equal_transformers_and_export_round_trip(tmp_path, folders, kind):
    from safetensors.torch import load_file
    from titan_llama3.state_dict_adapter import Llama3StateDictAdapter

    from titan_plugins.export.hf_folder import export_folder

    folder, ref = folders[kind]
    job, cfg, ours, counts = load_ours(folder, "model.attn_backend=sdpa")
    assert cfg.enable_weight_tying is (kind == "3.2_tied") and cfg.attention_bias is (kind == "bias_head_dim")
    assert cfg.rope_scaling.enabled is (kind != "bias_head_dim") and cfg.eos_id == 5
    assert cfg.head_size == (8 if kind == "bias_head_dim" else 16) and cfg.ffn_hidden_dim == 96
    tokens = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = ref(tokens).logits
        got = ours(tokens)
    diff = (got - want).abs().max().item()
    print(f"{kind}: max |logits - transformers| = {diff:.2e}")
    assert diff <= 1e-5, diff
    # every Hugging Face tensor was used (strict): the adapter's view of ours is the file's
    hf_sd = load_file(str(folder / "model.safetensors"))
    assert set(Llama3StateDictAdapter(cfg).to_hf(ours.state_dict())) == set(hf_sd)
    # and back out: config_to_hf + to_hf give a folder transformers loads strictly
    spec = get_plugin_manager().get_model("llama3")
    out = export_folder(spec, cfg, job, ours.state_dict(), tmp_path / "exported")
    again, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert type(again) is type(ref) and not any(info.values()), info
    for name, value in ref.state_dict().items():  # the very same tensors (q/k permuted back)
        assert torch.equal(again.state_dict()[name], value), name
    with torch.no_grad():
        assert (again.eval()(tokens).logits - got).abs().max().item() <= 1e-5


def test_config_round_trip_loads_in_transformers():
    from omegaconf import OmegaConf
    from titan_llama3.config import FLAVORS

    for base in KINDS.values():
        values = config_from_hf(transformers.LlamaConfig(**base).to_dict())
        cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(FLAVORS["debugmodel"]), values))
        again = transformers.AutoConfig.for_model(**config_to_hf(cfg))
        assert type(again) is transformers.LlamaConfig
        assert config_from_hf(again.to_dict()) == values


def test_transformers_4_rope_scaling_form():
    # a 4.x config.json: rope_theta at the top, rope_scaling with rope_type llama3
    hf = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64,
          "num_attention_heads": 4, "rope_theta": 500000.0,
          "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                           "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}
    values = config_from_hf(hf)
    assert values["rope_theta"] == 500000.0 and values["rope_scaling"]["scaling_factor"] == 32.0


@pytest.mark.parametrize(
    ("field", "value"),
    [("mlp_bias", True), ("hidden_act", "gelu"), ("attention_dropout", 0.1), ("quantization_config", {}),
     ("rope_parameters", {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0})],
)
def test_unhonourable_field_is_one_error(tmp_path, folders, field, value):
    folder = edited_copy(folders, tmp_path, "3.1", **{field: value})
    with pytest.raises(ConfigError) as err:
        prepare_job(["model=llama3", f"model.hf={folder}", *SYNTH, "training.seq_len=16"], get_plugin_manager())
    msg = str(err.value)
    assert "\n" not in msg and f"config.json: {field}" in msg and "model.hf=" in msg, msg


def test_train_from_folder_then_titan_export_is_the_trained_model(tmp_path):
    """2 steps from a tied folder with attention biases (one rank, DCP checkpoint on), then
    both export routes (``checkpoint.export_hf`` and titan-export from the DCP checkpoint):
    transformers loads each strictly and gives the trained model's logits and greedy
    continuations (fp32)."""
    from titan_plugins.data.tokenizer import DEFAULT_TOKENIZER
    from titan_plugins.testing.hf_check import check_export_is_trained_model

    folder, _ = hf_folder(tmp_path, "3.2_tied", attention_bias=True)
    (folder / "tokenizer.json").write_bytes(DEFAULT_TOKENIZER.read_bytes())  # a real one this time
    got = check_export_is_trained_model(
        "llama3", folder, tmp_path, [*SYNTH, "training.seq_len=16", "model.attn_backend=sdpa"],
        hf_attn="sdpa", steps=2)
    print(f"export vs trained: logits {got['logits_diff']:.1e}, loss {got['loss_diff']:.1e}, "
          f"moved {got['moved']:.2f}")
    assert got["logits_diff"] <= 1e-5 and got["config"]["tie_word_embeddings"] is True
    assert got["config"]["attention_bias"] is True and got["config"]["architectures"] == ["LlamaForCausalLM"]
