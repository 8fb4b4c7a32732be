"""Rank code for the in-process multi-rank checks (run by test_qwen3_parallel.py
through ``titan_plugins.testing.gloo.run_ranks``).

Every rank builds the single-process reference (seeded init), then the parallel model
as the trainer would (meta build -> optional pipeline-stage cut -> parallelize ->
``to_empty`` -> ``init_weights``), loads the reference weights into its shards, runs
one forward/backward on the same global batch and compares loss and full gradients.
"""

from __future__ import annotations

import dataclasses
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from omegaconf import OmegaConf
from titan_qwen3.config import FLAVORS
from titan_qwen3.model import build
from titan_qwen3.parallelize import parallelize
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor.parallel import loss_parallel
from torch.nn.attention import SDPBackend, sdpa_kernel

from titan_plugins.config.schema import JobConfig, ParallelismConfig
from titan_plugins.distributed.parallel_dims import ParallelDims


def _job(par: dict, training: dict):
    job = OmegaConf.structured(JobConfig(model={}))
    for key, value in par.items():
        job.parallelism[key] = value
    for key, value in training.items():
        job.training[key] = value
    return job


def _reference(cfg, seed):
    with torch.device("meta"):
        model = build(cfg)
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    with torch.no_grad():
        model.init_weights(torch.device("cpu"))
    return model


def _load_full(model, full_sd):
    with torch.no_grad():
        for name, t in model.state_dict().items():
            src = full_sd[name]
            if isinstance(t, DTensor):
                t.to_local().copy_(distribute_tensor(src, t.device_mesh, t.placements).to_local())
            else:
                t.copy_(src)


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


def check(case: dict) -> dict:
    """One case on this rank; returns the numbers to compare (rank 0 reports)."""
    world = dist.get_world_size()
    cfg = dataclasses.replace(FLAVORS[case["flavor"]], **case.get("overrides", {}))
    par = case["par"]
    dims = ParallelDims.from_config(ParallelismConfig(**par), world)
    dims.build_meshes("cpu")
    job = _job(par, case.get("training", {}))
    batch, seq = case.get("batch", 2), case.get("seq", 16)
    g = torch.Generator().manual_seed(11)
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq), generator=g)
    labels = torch.randint(0, cfg.vocab_size, (batch, seq), generator=g)
    tokens[0, seq // 3] = tokens[1, seq // 2] = cfg.eos_id % cfg.vocab_size  # documents end

    ref = _reference(cfg, seed=5)
    forward_only = case.get("forward_only", False)  # flex attention: no CPU backward
    if forward_only:
        with torch.no_grad():
            ref_logits = ref(tokens)
    with sdpa_kernel(SDPBackend.MATH) if not forward_only else torch.no_grad():
        if not forward_only:
            ref_loss = F.cross_entropy(ref(tokens).flatten(0, 1), labels.flatten(), reduction="sum") / labels.numel()
            ref_loss.backward()
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}

    # "stages": pipeline stages run one after another on the same ranks (each one
    # parallelized on its own, hidden states crossing as plain tensors).
    stages = case.get("stages") or [None]
    parts = []
    for stage in stages:
        with torch.device("meta"):
            part = build(cfg)
        if case.get("compute_dtype"):
            part.set_compute_dtype(getattr(torch, case["compute_dtype"]))
        if stage is not None:
            _cut_stage(part, **stage)
        part = parallelize(part, dims, job)
        part.to_empty(device="cpu")
        with torch.no_grad():
            part.init_weights(torch.device("cpu"))
        _load_full(part, ref.state_dict())
        if cfg.enable_weight_tying and part.tok_embeddings is not None:
            assert part.output.weight is part.tok_embeddings.weight, "tie broken"
        parts.append(part)
    out = {"rope_is_plain": all(type(p.rope_cache) is torch.Tensor for p in parts)}

    def model(x):
        for part in parts:
            x = part(x)
            if part.output is None:
                assert type(x) is torch.Tensor, "a stage must hand on a plain tensor"
        return x

    if forward_only:
        with torch.no_grad():
            logits = model(tokens)
        out["logits_dtensor"] = isinstance(logits, DTensor)
        full = logits.full_tensor() if isinstance(logits, DTensor) else logits
        out["max_logits_diff"] = (full - ref_logits).abs().max().item()
        return out

    dp = dims.dp_size
    dp_rank = dims.dp_rank()
    per = batch // dp
    local_tokens = tokens[dp_rank * per:(dp_rank + 1) * per]
    local_labels = labels[dp_rank * per:(dp_rank + 1) * per]
    with sdpa_kernel(SDPBackend.MATH):
        logits = model(local_tokens)
        if isinstance(logits, DTensor):
            with loss_parallel():
                loss = F.cross_entropy(logits.flatten(0, 1), local_labels.flatten(), reduction="sum")
                loss = loss / labels.numel()
                loss.backward()
            loss = loss.full_tensor() if isinstance(loss, DTensor) else loss
        else:
            loss = F.cross_entropy(logits.flatten(0, 1), local_labels.flatten(), reduction="sum") / labels.numel()
            loss.backward()
    loss = loss.detach().clone()
    if dp > 1:
        dist.all_reduce(loss, group=dims.mesh("dp").get_group())
    out["logits_dtensor"] = isinstance(logits, DTensor)
    out["loss"] = loss.item()
    out["ref_loss"] = ref_loss.item()
    worst, worst_name = 0.0, ""
    named = [item for part in parts for item in part.named_parameters()]
    for name, p in named:
        name = name.replace("_checkpoint_wrapped_module.", "")
        grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        if grad is None:
            raise AssertionError(f"no gradient for {name}")
        if not isinstance(p.grad, DTensor) and dp > 1:
            grad = grad.clone()
            dist.all_reduce(grad, group=dims.mesh("dp").get_group())
        diff = (grad - ref_grads[name]).abs().max().item()
        if diff > worst:
            worst, worst_name = diff, name
    out["max_grad_diff"] = worst
    out["worst"] = worst_name
    return out


def main(rank: int, world: int, cases: list[dict]) -> list[dict]:
    """One rank: every case in turn (rank 0's numbers are the ones compared)."""
    warnings.filterwarnings("ignore", message="DTensor random operators")
    warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
    return [check(case) for case in cases]
