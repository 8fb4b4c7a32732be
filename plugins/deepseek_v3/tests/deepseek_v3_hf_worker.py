"""Rank code for the sharded Hugging Face load check (spawned by test_deepseek_v3_hf.py).

Per case every rank loads the folder whole into a single-process model (the
reference) and the parallel model as the trainer builds it (meta build ->
parallelize -> ``to_empty`` -> ``init_weights`` -> ``load_hf_weights``, which reads
only the rank's slices: under EP only its own experts), then compares logits.
"""

from __future__ import annotations

import json
import os
import traceback
import warnings

import torch
import torch.distributed as dist
from omegaconf import OmegaConf
from titan_deepseek_v3.config import FLAVORS
from titan_deepseek_v3.hf_config import config_from_hf
from titan_deepseek_v3.model import build
from titan_deepseek_v3.parallelize import parallelize
from torch.distributed.tensor import DTensor

from titan_plugins.config.schema import JobConfig, ParallelismConfig
from titan_plugins.distributed.parallel_dims import ParallelDims
from titan_plugins.distributed.teardown import destroy_process_groups
from titan_plugins.hf.load import load_hf_weights
from titan_plugins.plugins import get_plugin_manager

SEQ = 16


def check(folder: str, par: dict, spec) -> dict:
    values = config_from_hf(json.loads(open(os.path.join(folder, "config.json")).read()))
    values["max_seq_len"] = SEQ  # as the Hydra option does (training.seq_len)
    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(FLAVORS["debugmodel"]), values))
    dims = ParallelDims.from_config(ParallelismConfig(**par), dist.get_world_size())
    dims.build_meshes("cpu")
    job = OmegaConf.structured(JobConfig(model={}))
    job.training.seq_len = SEQ
    for key, value in par.items():
        job.parallelism[key] = value
    tokens = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(3))

    ref = build(cfg)
    with torch.no_grad():
        ref.init_weights()
    load_hf_weights([ref], spec, cfg, folder)
    with torch.device("meta"):
        model = build(cfg)
    model = parallelize(model, dims, job)
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(torch.device("cpu"))
    counts = load_hf_weights([model], spec, cfg, folder)
    local_experts = model.layers["1"].moe.experts.w1
    local_experts = local_experts.to_local() if isinstance(local_experts, DTensor) else local_experts
    with torch.no_grad():
        want = ref(tokens)
        got = model(tokens)
    got = got.full_tensor() if isinstance(got, DTensor) else got
    return {"max_logits_diff": (got - want).abs().max().item(), "read_whole": counts["loaded"] - counts["sliced"],
            "kept": counts["kept"], "local_experts": local_experts.shape[0]}


def main(rank: int, world: int, port: int, folder: str, cases: list[dict], result_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message="DTensor random operators")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    spec = get_plugin_manager().get_model("deepseek_v3")
    results, finished = [], False
    try:
        for par in cases:
            results.append(check(folder, par, spec))
        finished = True
    except Exception:
        results.append({"error": traceback.format_exc()})
        raise
    finally:
        if rank == 0:
            torch.save(results, os.path.join(result_dir, "results.pt"))
        destroy_process_groups(synchronize=finished)
