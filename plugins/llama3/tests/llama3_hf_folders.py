"""Tiny random ``LlamaForCausalLM`` folders for the Hugging Face tests (test_llama3_hf.py
and the sharded-load layouts of test_llama3_parallel.py): built by transformers from
configs shaped like the released ones and written with ``save_pretrained`` (nothing is
downloaded). transformers is imported on first use only: the ranks never need it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

# Llama 3.1 8B's shape in small: GQA, rope_type llama3 (factor 8, original context 32 so
# that the kept, interpolated and divided frequency bands all occur at head_dim 16).
LLAMA31: dict[str, Any] = dict(
    vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5, tie_word_embeddings=False,
    rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
    bos_token_id=1, eos_token_id=[5, 6],
)
KINDS: dict[str, dict[str, Any]] = {
    "3.1": LLAMA31,
    # Llama 3.2 1B/3B: tied embeddings, factor 32
    "3.2_tied": dict(LLAMA31, tie_word_embeddings=True,
                     rope_parameters=dict(LLAMA31["rope_parameters"], factor=32.0)),
    # a fine-tune with attention biases, explicit head_dim != hidden/heads, plain RoPE
    "bias_head_dim": dict(LLAMA31, attention_bias=True, head_dim=8,
                          rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
}
SYNTH = ["data.name=synthetic", "data.vocab_size=96"]  # the test folders' tokenizer is a stub


def hf_folder(root: str | Path, kind: str, *, name: str | None = None, **extra: Any):
    """``(folder, model)``: a seeded random ``LlamaForCausalLM`` of ``KINDS[kind]`` (plus
    ``extra`` config fields) saved under ``root/(name or kind)``, in eval mode."""
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(**{**KINDS[kind], **extra})
    model = transformers.LlamaForCausalLM(cfg)
    model.eval()
    with torch.no_grad():  # random (not HF's near-zero init) so every weight (and bias) matters
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    folder = Path(root) / (name or kind)
    model.save_pretrained(folder)
    (folder / "tokenizer.json").write_text("{}")  # only its presence matters here
    return folder, model
