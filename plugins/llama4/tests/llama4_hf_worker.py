"""Rank code for the sharded Hugging Face load check (run by test_llama4_hf.py
through ``titan_plugins.testing.gloo.run_ranks``).

Per case every rank loads the folder whole into a single-process model (the
reference), and the parallel model as the trainer builds it (meta build ->
parallelize -> ``to_empty`` -> ``init_weights`` -> ``load_hf_weights``, reading
the rank's slices where the layouts allow), then compares logits. qwen3's worker,
for Llama 4.
"""

from __future__ import annotations

import json
import os
import warnings

import torch
from omegaconf import OmegaConf
from titan_llama4.config import FLAVORS
from titan_llama4.hf_config import config_from_hf
from titan_llama4.model import build
from titan_llama4.parallelize import parallelize
from torch.distributed.tensor import DTensor
from torch.nn.attention import SDPBackend, sdpa_kernel

from titan_plugins.hf.load import load_hf_weights
from titan_plugins.plugins import get_plugin_manager
from titan_plugins.testing import model_parts


def _config(folder: str):
    values = config_from_hf(json.loads(open(os.path.join(folder, "config.json")).read()))
    values["attn_backend"] = "sdpa"
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(FLAVORS["debugmodel"]), values))


def check(folder: str, par: dict, spec) -> dict:
    cfg = _config(folder)
    dims, job = model_parts.layout(par)
    tokens = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(3))

    ref = build(cfg)
    with torch.no_grad():
        ref.init_weights()
    load_hf_weights([ref], spec, cfg, folder)
    model = model_parts.build_part(build, cfg, parallelize, dims, job)
    counts = load_hf_weights([model], spec, cfg, folder)
    sharded = sum(isinstance(v, DTensor) and v.to_local().numel() < v.numel() for v in model.state_dict().values())
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH):
        want = ref(tokens)
        got = model(tokens)
    return {"max_logits_diff": (model_parts.full(got) - want).abs().max().item(), "sharded_entries": sharded, **counts}


def main(rank: int, world: int, folder: str, cases: list[dict]) -> list[dict]:
    """One rank: every layout in turn."""
    warnings.filterwarnings("ignore", message="DTensor random operators")
    spec = get_plugin_manager().get_model("llama4")
    return [check(folder, par, spec) for par in cases]
