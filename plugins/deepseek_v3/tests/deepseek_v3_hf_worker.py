"""Rank code for the sharded Hugging Face load check (run by test_deepseek_v3_hf.py
through ``titan_plugins.testing.gloo.run_ranks``).

Per case every rank loads the folder whole into a single-process model (the
reference) and the parallel model as the trainer builds it (meta build ->
parallelize -> ``to_empty`` -> ``init_weights`` -> ``load_hf_weights``, which reads
only the rank's slices: under EP only its own experts), then compares logits.
"""

from __future__ import annotations

import json
import os
import warnings

import torch
from omegaconf import OmegaConf
from titan_deepseek_v3.config import FLAVORS
from titan_deepseek_v3.hf_config import config_from_hf
from titan_deepseek_v3.model import build
from titan_deepseek_v3.parallelize import parallelize
from torch.distributed.tensor import DTensor

from titan_plugins.hf.load import load_hf_weights
from titan_plugins.plugins import get_plugin_manager
from titan_plugins.testing.model_parts import build_part, full, layout

SEQ = 16


def check(folder: str, par: dict, spec) -> dict:
    values = config_from_hf(json.loads(open(os.path.join(folder, "config.json")).read()))
    values["max_seq_len"] = SEQ  # as the Hydra option does (training.seq_len)
    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(FLAVORS["debugmodel"]), values))
    dims, job = layout(par, {"seq_len": SEQ})
    tokens = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(3))

    ref = build(cfg)
    with torch.no_grad():
        ref.init_weights()
    load_hf_weights([ref], spec, cfg, folder)
    model = build_part(build, cfg, parallelize, dims, job)
    counts = load_hf_weights([model], spec, cfg, folder)
    local_experts = model.layers["1"].moe.experts.w1
    local_experts = local_experts.to_local() if isinstance(local_experts, DTensor) else local_experts
    with torch.no_grad():
        want = ref(tokens)
        got = model(tokens)
    return {"max_logits_diff": (full(got) - want).abs().max().item(), "read_whole": counts["loaded"] - counts["sliced"],
            "kept": counts["kept"], "local_experts": local_experts.shape[0]}


def main(rank: int, world: int, folder: str, cases: list[dict]) -> list[dict]:
    """One rank: every layout in turn."""
    warnings.filterwarnings("ignore", message="DTensor random operators")
    spec = get_plugin_manager().get_model("deepseek_v3")
    return [check(folder, par, spec) for par in cases]
