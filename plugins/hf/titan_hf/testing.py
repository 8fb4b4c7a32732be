"""Tiny random Hugging Face folders for tests (nothing is downloaded).

    folder = save_folder("tiny_mistral", tmp_path / "mistral")   # config.json + model.safetensors

The flavor's config.json is built by transformers with random weights (normal, std
``std``: every weight matters, unlike HF's near-zero init) and written with
``save_pretrained``, so the folder is what a user's checkpoint looks like.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from titan_hf.config import FLAVORS, AttnImpl

__all__ = ["reference_model", "save_folder"]


def save_folder(flavor: str, folder: str | Path, *, seed: int = 0, std: float = 0.2,
                **overrides: Any) -> Path:
    """Write flavor ``flavor`` (``titan_hf.config.FLAVORS``) as a transformers folder."""
    from transformers import AutoModelForCausalLM

    from titan_hf.model import hf_config_object

    config = FLAVORS[flavor]
    hf = hf_config_object(config)
    for key, value in overrides.items():
        setattr(hf, key, value)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf, attn_implementation=AttnImpl(config.attn_implementation).value)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and p.dim() == 1:
                p.normal_(1.0 if "gemma" not in hf.model_type else 0.0, std)
            else:
                p.normal_(0.0, std)
    folder = Path(folder)
    model.save_pretrained(folder)
    return folder


def reference_model(folder: str | Path, attn: str | None = None) -> torch.nn.Module:
    """The plain transformers model of ``folder`` (fp32, eval; SDPA unless the
    architecture runs eager only)."""
    import json

    from transformers import AutoModelForCausalLM

    from titan_hf.config import EAGER_ONLY

    arch = json.loads((Path(folder) / "config.json").read_text())["architectures"][0]
    attn = attn or ("eager" if arch in EAGER_ONLY else "sdpa")
    return AutoModelForCausalLM.from_pretrained(folder, attn_implementation=attn, dtype=torch.float32).eval()
