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
from titan_llama3.config import FLAVORS
from titan_llama3.model import build
from titan_llama3.parallelize import parallelize
from torch.distributed.tensor import DTensor
from torch.nn.attention import SDPBackend, sdpa_kernel

from titan_plugins.hf.load import load_hf_weights
from titan_plugins.plugins import get_plugin_manager
from titan_plugins.testing import model_parts as parts_of

LR = 0.5


def _full_grad(p, dp_group):
    if isinstance(p.grad, DTensor):
        return p.grad.full_tensor()
    grad = p.grad.clone()
    if dp_group is not None:  # not sharded by FSDP: sum the data-parallel slices here
        dist.all_reduce(grad, group=dp_group)
    return grad


def _parallel_parts(cfg, dims, job, stages) -> list:
    """The trainer's build: meta -> optional stage cut -> parallelize -> to_empty -> init."""
    return [parts_of.build_part(build, cfg, parallelize, dims, job, stage) for stage in stages or [None]]


def check_hf(case: dict, dims, job) -> dict:
    """Sharded ``model.hf`` load: every rank reads its shards of the folder."""
    cfg = case["cfg"]
    spec = get_plugin_manager().get_model("llama3")
    parts = _parallel_parts(cfg, dims, job, case.get("stages"))
    counts = {"loaded": 0, "sliced": 0, "kept": 0, "tied": 0}
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
    logits = parts_of.full(x)
    return {**counts, "cfg": cfg, "permuted": permuted, "sharded_entries": sharded, "logits": logits,
            "freqs_cis_plain": all(type(p.freqs_cis) is torch.Tensor for p in parts)}


def check(case: dict) -> dict:
    """One case on this rank; every rank returns the same numbers."""
    par, steps = case["par"], case.get("steps", 2)
    dims, job = parts_of.layout(par, case.get("training", {}))
    if "hf" in case:
        return check_hf(case, dims, job)
    cfg = dataclasses.replace(FLAVORS["debugmodel"], **case["model"])
    batch, seq = case.get("batch", 4), case.get("seq", 16)
    g = torch.Generator().manual_seed(11)
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq), generator=g)
    labels = torch.randint(0, cfg.vocab_size, (batch, seq), generator=g)
    tokens[0, seq // 3] = tokens[1, seq // 2] = cfg.eos_id % cfg.vocab_size  # documents end

    ref = parts_of.seeded_build(build, cfg, seed=5)
    start = {k: v.clone() for k, v in ref.state_dict().items()}

    parts = _parallel_parts(cfg, dims, job, case.get("stages"))
    for part in parts:
        parts_of.load_full_state_dict(part, start)
        if cfg.enable_weight_tying and part.tok_embeddings is not None:
            assert part.output.weight is part.tok_embeddings.weight, "tie broken"
    out = {"freqs_cis_plain": all(type(p.freqs_cis) is torch.Tensor for p in parts)}

    def model(x):
        return parts_of.run_stages(parts, x)

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
            ref_loss = parts_of.sum_loss(ref(tokens), labels, labels.numel())
            logits = model(tokens[local])
            loss = parts_of.sum_loss(logits, labels[local], labels.numel()).detach().clone()
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
