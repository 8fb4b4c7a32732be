"""The GPT-2 example from and to a Hugging Face GPT2LMHeadModel folder (built
locally with random weights): logits equal transformers', export loads strictly.

Only the public API: ``titan_plugins.hf`` (load_hf_model, export_model) and
``titan_plugins.errors``; nothing of the core's private modules."""

import json

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from titan_plugins.errors import ConfigError  # noqa: E402
from titan_plugins.hf import export_model, load_hf_model  # noqa: E402


@pytest.fixture
def hf_folder(tmp_path):
    torch.manual_seed(0)
    hf_cfg = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=80, n_positions=32,
                                     tie_word_embeddings=False, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    ref = transformers.GPT2LMHeadModel(hf_cfg).eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0.0, 0.2)
    ref.save_pretrained(tmp_path / "hf")
    return ref, tmp_path / "hf"


def test_gpt2_folder_round_trip(hf_folder, tmp_path):
    ref, folder = hf_folder
    ours = load_hf_model("gpt2", folder)
    cfg = ours.config
    assert (cfg.dim, cfg.n_layers, cfg.vocab_size, cfg.max_seq_len) == (32, 2, 80, 32)
    assert not ours.training  # eval mode, as from_pretrained
    tokens = torch.randint(0, 80, (2, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want, got = ref(tokens).logits, ours(tokens)
    assert (got - want).abs().max().item() <= 1e-5

    out = export_model(ours, "gpt2", tmp_path / "out")
    again, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not any(info.values()), info
    with torch.no_grad():
        assert (again.eval()(tokens).logits - got).abs().max().item() <= 1e-5
    # what the folder said and the model did not change comes back as the folder said it
    source, written = (json.loads((p / "config.json").read_text()) for p in (folder, out))
    assert {k: written[k] for k in ("n_embd", "n_positions", "layer_norm_epsilon")} == \
        {k: source[k] for k in ("n_embd", "n_positions", "layer_norm_epsilon")}
    with pytest.raises(ConfigError, match="holds an earlier full export; pass overwrite=True"):  # never over what is there, unless asked
        export_model(ours, "gpt2", out)
    assert export_model(ours, "gpt2", out, overwrite=True) == out


def test_overrides_and_refused_fields(hf_folder):
    _, folder = hf_folder
    with pytest.raises(ConfigError, match=r"model\.n_layers=1: .* has 2 layers"):
        load_hf_model("gpt2", folder, overrides=["model.n_layers=1"])
    part = load_hf_model("gpt2", folder, overrides={"n_layers": 1, "hf_partial": True})
    assert len(part.layers) == 1

    data = json.loads((folder / "config.json").read_text())
    data["tie_word_embeddings"] = True
    (folder / "config.json").write_text(json.dumps(data))
    with pytest.raises(ConfigError, match=r"config\.json: tie_word_embeddings=True: "):
        load_hf_model("gpt2", folder)
