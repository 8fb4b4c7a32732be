"""What a LoRA run on a Hugging Face folder is held to, for tests (nothing is downloaded).

- :func:`tiny_qwen3_folder`: the base such a run starts from, a random Qwen3 written by
  transformers with the shipped ChatML tokenizer (``data=chat_sample`` and the preference
  sets read the folder's tokenizer);
- :func:`hf_logits`: the logits transformers gives a full folder (a merged export, a
  run's ``hf/``), loaded strictly;
- :func:`peft_logits`: the logits transformers + peft give the base with an adapter folder.

Needs ``transformers`` and ``peft`` (test-only references), imported on use.
"""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path
from typing import Any

import torch

__all__ = ["TINY_QWEN3", "hf_logits", "peft_logits", "tiny_qwen3_folder"]

TINY_QWEN3: dict[str, Any] = dict(  # the vocabulary of the shipped (chat) tokenizer: runs can train on chat data
    vocab_size=2048, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=64, rope_theta=10000.0,
    tie_word_embeddings=False, eos_token_id=5,
)


def tiny_qwen3_folder(path: str | Path, *, seed: int = 0, std: float = 0.2, **config: Any) -> Path:
    """Write a random ``Qwen3ForCausalLM`` (``TINY_QWEN3`` updated by ``config``; every
    weight normal with std ``std``, so every weight matters) and the ChatML tokenizer to
    ``path``."""
    import transformers

    from titan_plugins.data.tokenizer import ASSETS

    path = Path(path)
    torch.manual_seed(seed)
    model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**{**TINY_QWEN3, **config}))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, std)
    model.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(ASSETS / "chat_tokenizer" / name, path / name)
    return path


def hf_logits(folder: str | Path, tokens: torch.Tensor) -> torch.Tensor:
    """A full Hugging Face folder loaded strictly (nothing missing or unexpected): its
    logits of ``tokens``."""
    import transformers

    model, info = transformers.AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
    assert not any(info.values()), info
    with torch.no_grad():
        return model.eval()(tokens).logits


def peft_logits(base: str | Path, adapter: str | Path, tokens: torch.Tensor) -> torch.Tensor:
    """transformers + peft on the ``base`` folder with the ``adapter`` folder: logits of
    ``tokens`` (and no warning about missing or unexpected adapter keys)."""
    import peft
    import transformers

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        theirs = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(base), adapter)
    assert not [w for w in caught if "adapter" in str(w.message).lower() and "key" in str(w.message).lower()]
    with torch.no_grad():
        return theirs.eval()(tokens).logits
