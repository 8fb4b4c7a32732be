"""Rank code for the sharded Hugging Face load check (run by test_qwen3_hf.py
through ``titan_plugins.testing.gloo.run_ranks``).

Per case every rank loads the folder whole into a single-process model (the
reference), and the parallel model as the trainer builds it (meta build ->
optional pipeline-stage cut -> parallelize -> ``to_empty`` -> ``init_weights`` ->
``load_hf_weights``, which reads only the rank's slices), then compares logits.
"""

from __future__ import annotations

import json
import os
import warnings

import torch
from omegaconf import OmegaConf
from titan_qwen3.config import FLAVORS
from titan_qwen3.hf_config import config_from_hf
from titan_qwen3.model import build
from titan_qwen3.parallelize import parallelize
from torch.distributed.tensor import DTensor
from torch.nn.attention import SDPBackend, sdpa_kernel

from titan_plugins.hf.load import load_hf_weights
from titan_plugins.plugins import get_plugin_manager
from titan_plugins.testing.model_parts import build_part, full, layout


def _config(folder: str, flavor: str):
    values = config_from_hf(json.loads(open(os.path.join(folder, "config.json")).read()))
    values["attn_backend"] = "sdpa"
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(FLAVORS[flavor]), values))


def check(case: dict, spec) -> dict:
    cfg = _config(case["folder"], case["flavor"])
    dims, job = layout(case["par"])
    tokens = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(3))

    ref = build(cfg)
    with torch.no_grad():
        ref.init_weights()
    load_hf_weights([ref], spec, cfg, case["folder"])
    parts, sharded, whole = [], 0, 0
    for stage in case.get("stages") or [None]:
        part = build_part(build, cfg, parallelize, dims, job, stage)
        counts = load_hf_weights([part], spec, cfg, case["folder"])
        whole += counts["loaded"] - counts["sliced"]
        sharded += sum(isinstance(v, DTensor) and v.to_local().numel() < v.numel() for v in part.state_dict().values())
        parts.append(part)
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH):
        want = ref(tokens)
        x = tokens
        for part in parts:
            x = part(x)
    return {"max_logits_diff": (full(x) - want).abs().max().item(), "sharded_entries": sharded, "read_whole": whole}


def main(rank: int, world: int, cases: list[dict]) -> list[dict]:
    """One rank: every case in turn."""
    warnings.filterwarnings("ignore", message="DTensor random operators")
    spec = get_plugin_manager().get_model("qwen3")
    return [check(case, spec) for case in cases]
