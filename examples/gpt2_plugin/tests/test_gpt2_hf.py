"""The GPT-2 example from and to a Hugging Face GPT2LMHeadModel folder (built
locally with random weights): logits equal transformers', export loads strictly."""

import json

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")


def test_gpt2_folder_round_trip(tmp_path):
    from titan_plugins.config.hydra_glue import model_config
    from titan_plugins.errors import ConfigError
    from titan_plugins.hf.export import export_folder
    from titan_plugins.hf.load import load_hf_weights
    from titan_plugins.plugins import get_plugin_manager
    from titan_plugins.train.api import prepare_job

    torch.manual_seed(0)
    hf_cfg = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=80, n_positions=32,
                                     tie_word_embeddings=False, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    ref = transformers.GPT2LMHeadModel(hf_cfg).eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0.0, 0.2)
    ref.save_pretrained(tmp_path / "hf")
    pm = get_plugin_manager()
    synth = ["data.name=synthetic", "data.vocab_size=80", "training.seq_len=16"]
    spec, job, _ = prepare_job(["model=gpt2", f"model.hf={tmp_path / 'hf'}", *synth], pm)
    cfg = model_config(job.model, spec)
    assert (cfg.dim, cfg.n_layers, cfg.vocab_size) == (32, 2, 80)
    ours = spec.load("build")(cfg)
    with torch.no_grad():
        ours.init_weights()
    counts = load_hf_weights([ours], spec, cfg, tmp_path / "hf")
    assert counts["kept"] == 0
    tokens = torch.randint(0, 80, (2, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want, got = ref(tokens).logits, ours.eval()(tokens)
    assert (got - want).abs().max().item() <= 1e-5

    out = export_folder(spec, cfg, job, ours.state_dict(), tmp_path / "out")
    again, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not any(info.values()), info
    with torch.no_grad():
        assert (again.eval()(tokens).logits - got).abs().max().item() <= 1e-5

    data = json.loads((tmp_path / "hf" / "config.json").read_text())
    data["tie_word_embeddings"] = True
    (tmp_path / "hf" / "config.json").write_text(json.dumps(data))
    with pytest.raises(ConfigError, match=r"config\.json: tie_word_embeddings=True: "):
        prepare_job(["model=gpt2", f"model.hf={tmp_path / 'hf'}", *synth], pm)
