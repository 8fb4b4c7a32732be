"""Rank code for the in-process multi-rank check (run by test_llama3_parallel.py through
``titan_plugins.testing.gloo.run_ranks``: one launch, every layout in turn).

Per case every rank builds the single-process reference (seeded init), then the parallel
model as the trainer would (meta build -> optional pipeline-stage cut -> parallelize ->
``to_empty`` -> ``init_weights``), loads the reference weights into its shards and trains
both for ``steps`` SGD steps on the same global batch (each data-parallel rank its slice,
the loss divided by the global token count as the trainer does): the losses of every
step and the first step's full gradients are compared.

A case with ``hf`` (a saved ``LlamaForCausalLM`` folder, its ``cfg`` composed by the
caller through ``model.hf``) instead loads the folder into the parallel model with
``load_hf_weights`` (each rank reads its shards) and returns the logits of ``tokens``
for the caller to compare with transformers'.
"""

from __future__ import annotations

import dataclasses
import time
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from omegaconf import OmegaConf
from titan_llama3.config import FLAVORS
from titan_llama3.model import build
from titan_llama3.parallelize import parallelize
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor.parallel import loss_parallel
from torch.nn.attention import SDPBackend, sdpa_kernel

from titan_plugins.config.schema import JobConfig, ParallelismConfig
from titan_plugins.distributed.parallel_dims import ParallelDims
from titan_plugins.hf.load import load_hf_weights
from titan_plugins.plugins import get_plugin_manager

LR = 0.5


def _job(par: dict, training: dict):
    job = OmegaConf.structured(JobConfig(model={}))
    for key, value in par.items():
        job.parallelism[key] = value
    for key, value in training.items():
        job.training[key] = value
    return job


def _load_full(model, full_sd):
    with torch.no_grad():
        for name, t in model.state_dict().items():
            if isinstance(t, DTensor):
                t.to_local().copy_(distribute_tensor(full_sd[name], t.device_mesh, t.placements).to_local())
            else:
                t.copy_(full_sd[name])


def _cut_stage(model, keep: list[str], first: bool, last: bool):
    """What the runtime's pipeline split leaves on one stage."""
    for key in list(model.layers.keys()):
        if key not in keep:
            del model.layers[key]
    if not first:
        model.tok_embeddings = None
    if not last:
        model.norm = None
        model.output = None


def _loss(logits, labels, count):
    if isinstance(logits, DTensor):  # loss parallel: logits sharded on the vocabulary
        with loss_parallel():
            loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum") / count
            loss.backward()
        return loss.full_tensor() if isinstance(loss, DTensor) else loss
    loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum") / count
    loss.backward()
    return loss


def _full_grad(p, dp_group):
    if isinstance(p.grad, DTensor):
        return p.grad.full_tensor()
    grad = p.grad.clone()
    if dp_group is not None:  # not sharded by FSDP: sum the data-parallel slices here
        dist.all_reduce(grad, group=dp_group)
    return grad


def _parallel_parts(cfg, dims, job, stages) -> list:
    """The trainer's build: meta -> optional stage cut -> parallelize -> to_empty -> init."""
    parts = []
    for stage in stages or [None]:
        with torch.device("meta"):
            part = build(cfg)
        if stage is not None:
            _cut_stage(part, **stage)
        part = parallelize(part, dims, job)
        part.to_empty(device="cpu")
        with torch.no_grad():
            part.init_weights(torch.device("cpu"))
        parts.append(part)
    return parts


def check_hf(case: dict, dims, job) -> dict:
    """Sharded ``model.hf`` load: every rank reads its shards of the folder."""
    cfg = case["cfg"]
    spec = get_plugin_manager().get_model("llama3")
    parts = _parallel_parts(cfg, dims, job, case.get("stages"))
    counts = {"loaded": 0, "sliced": 0, "kept": 0}
    permuted = sharded = 0
    for part in parts:
        for key, value in load_hf_weights([part], spec, cfg, case["hf"], verbose=False).items():
            counts[key] += value
        for key, value in part.state_dict().items():
            permuted += ".attention.wq." in key or ".attention.wk." in key
            sharded += isinstance(value, DTensor) and value.to_local().numel() < value.numel()
        if cfg.enable_weight_tying and part.tok_embeddings is not None:
            assert part.output.weight is part.tok_embeddings.weight, "tie broken"
    x = case["tokens"]
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH):
        for part in parts:
            x = part(x)
    logits = x.full_tensor() if isinstance(x, DTensor) else x
    return {**counts, "cfg": cfg, "permuted": permuted, "sharded_entries": sharded, "logits": logits,
            "freqs_cis_plain": all(type(p.freqs_cis) is torch.Tensor for p in parts)}


def check(case: dict) -> dict:
    """One case on this rank; every rank returns the same numbers."""
    par, steps = case["par"], case.get("steps", 2)
    dims = ParallelDims.from_config(ParallelismConfig(**par), dist.get_world_size())
    dims.build_meshes("cpu")
    job = _job(par, case.get("training", {}))
    if "hf" in case:
        return check_hf(case, dims, job)
    cfg = dataclasses.replace(FLAVORS["debugmodel"], **case["model"])
    batch, seq = case.get("batch", 4), case.get("seq", 16)
    g = torch.Generator().manual_seed(11)
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq), generator=g)
    labels = torch.randint(0, cfg.vocab_size, (batch, seq), generator=g)
    tokens[0, seq // 3] = tokens[1, seq // 2] = cfg.eos_id % cfg.vocab_size  # documents end

    with torch.device("meta"):
        ref = build(cfg)
    ref.to_empty(device="cpu")
    torch.manual_seed(5)
    with torch.no_grad():
        ref.init_weights(torch.device("cpu"))
    start = {k: v.clone() for k, v in ref.state_dict().items()}

    parts = _parallel_parts(cfg, dims, job, case.get("stages"))
    for part in parts:
        _load_full(part, start)
        if cfg.enable_weight_tying and part.tok_embeddings is not None:
            assert part.output.weight is part.tok_embeddings.weight, "tie broken"
    out = {"freqs_cis_plain": all(type(p.freqs_cis) is torch.Tensor for p in parts)}

    def model(x):
        for part in parts:
            x = part(x)
            if part.output is None:
                assert type(x) is torch.Tensor, "a stage must hand on a plain tensor"
        return x

    dp, dp_rank = dims.dp_size, dims.dp_rank()
    per = batch // dp
    local = slice(dp_rank * per, (dp_rank + 1) * per)
    dp_group = dims.mesh("dp").get_group() if dp > 1 else None
    params = [p for part in parts for p in part.parameters()]
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR)
    opt = torch.optim.SGD(params, lr=LR)
    out.update(ref_losses=[], losses=[])
    for step in range(steps):
        with sdpa_kernel(SDPBackend.MATH):
            ref_loss = _loss(ref(tokens), labels, labels.numel())
            logits = model(tokens[local])
            loss = _loss(logits, labels[local], labels.numel()).detach().clone()
        if dp_group is not None:
            dist.all_reduce(loss, group=dp_group)
        out["ref_losses"].append(ref_loss.item())
        out["losses"].append(loss.item())
        if step == 0:
            out["logits_dtensor"] = isinstance(logits, DTensor)
            worst, worst_name = 0.0, ""
            ref_grads = dict(ref.named_parameters())
            for name, p in (item for part in parts for item in part.named_parameters()):
                name = name.replace("_checkpoint_wrapped_module.", "")
                if p.grad is None:
                    raise AssertionError(f"no gradient for {name}")
                diff = (_full_grad(p, dp_group if not isinstance(p.grad, DTensor) else None)
                        - ref_grads[name].grad).abs().max().item()
                if diff > worst:
                    worst, worst_name = diff, name
            out["max_grad_diff"], out["worst"] = worst, worst_name
        ref_opt.step()
        ref_opt.zero_grad()
        opt.step()
        opt.zero_grad()
    return out


def main(rank: int, world: int, cases: list[dict]) -> list[dict]:
    """One rank: every case in turn."""
    warnings.filterwarnings("ignore", message="DTensor random operators")
    out = []
    for case in cases:
        start = time.perf_counter()
        out.append({**check(case), "seconds": time.perf_counter() - start})
    return out
