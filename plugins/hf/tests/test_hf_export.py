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
