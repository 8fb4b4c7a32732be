"""``model=hf`` out to a Hugging Face folder: train 2 steps from a folder, export by both
routes (``checkpoint.export_hf`` and ``titan-export`` of the DCP checkpoint); transformers
loads each strictly and gives the trained model's logits (the core's check)."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from titan_hf.testing import save_folder  # noqa: E402


@pytest.mark.slow
def test_train_then_export_is_the_trained_model(tmp_path):
    from titan_plugins.data.tokenizer import DEFAULT_TOKENIZER
    from titan_plugins.testing.hf_check import check_export_is_trained_model

    # Gemma 3: tied (no lm_head in the folder, none written back), sliding + full layers
    folder = save_folder("tiny_gemma3", tmp_path / "gemma3", vocab_size=2048)
    (folder / "tokenizer.json").write_bytes(DEFAULT_TOKENIZER.read_bytes())
    got = check_export_is_trained_model("hf", folder, tmp_path, ["data=synthetic", "training.seq_len=16"],
                                        hf_attn="sdpa", steps=2)
    print(f"export vs trained: logits {got['logits_diff']:.1e}, loss {got['loss_diff']:.1e}, moved {got['moved']:.2f}")
    assert got["logits_diff"] <= 1e-5
    assert got["config"]["architectures"] == ["Gemma3ForCausalLM"] and got["config"]["tie_word_embeddings"] is True
    assert got["config"]["layer_types"] == ["sliding_attention", "full_attention"]


def test_export_keeps_a_field_stated_null(tmp_path):
    """config.json's ``"pad_token_id": null`` is written back as null, not dropped (issue
    46.8): dropped, transformers falls back to Phi-3's default 32000, outside a 2,048-token
    vocabulary, and ``from_pretrained`` of the export fails."""
    import json

    import torch
    from transformers import AutoModelForCausalLM

    from titan_plugins.hf import export_model, load_hf_model

    folder = save_folder("tiny_phi3", tmp_path / "phi3", vocab_size=2048)
    assert json.loads((folder / "config.json").read_text())["pad_token_id"] is None
    model = load_hf_model("hf", folder, overrides=["data=synthetic", "data.vocab_size=2048"])
    out = export_model(model, "hf", tmp_path / "exported")
    written = json.loads((out / "config.json").read_text())
    assert "pad_token_id" in written and written["pad_token_id"] is None
    exported = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert exported.config.pad_token_id is None and exported.config.vocab_size == 2048


def test_a_typed_field_stated_null_stays_null():
    """A typed field the folder states as null (``max_position_embeddings: null``) reaches
    transformers and the export as null, not as the class's default."""
    from titan_hf.config import HFModelConfig, config_from_hf, config_to_hf

    source = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 256, "hidden_size": 64,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": None, "pad_token_id": None}
    written = config_to_hf(HFModelConfig(**config_from_hf(source)))
    assert written["max_position_embeddings"] is None and written["pad_token_id"] is None
