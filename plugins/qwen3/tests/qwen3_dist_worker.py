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
from titan_qwen3.config import FLAVORS
from titan_qwen3.model import build
from titan_qwen3.parallelize import parallelize
from torch.distributed.tensor import DTensor
from torch.nn.attention import SDPBackend, sdpa_kernel

from titan_plugins.testing.model_parts import (
    build_part,
    full,
    layout,
    load_full_state_dict,
    run_stages,
    seeded_build,
    sum_loss,
)


def check(case: dict) -> dict:
    """One case on this rank; returns the numbers to compare (rank 0 reports)."""
    cfg = dataclasses.replace(FLAVORS[case["flavor"]], **case.get("overrides", {}))
    dims, job = layout(case["par"], case.get("training", {}))
    batch, seq = case.get("batch", 2), case.get("seq", 16)
    g = torch.Generator().manual_seed(11)
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq), generator=g)
    labels = torch.randint(0, cfg.vocab_size, (batch, seq), generator=g)
    tokens[0, seq // 3] = tokens[1, seq // 2] = cfg.eos_id % cfg.vocab_size  # documents end

    ref = seeded_build(build, cfg, seed=5)
    forward_only = case.get("forward_only", False)  # flex attention: no CPU backward
    if forward_only:
        with torch.no_grad():
            ref_logits = ref(tokens)
    with sdpa_kernel(SDPBackend.MATH) if not forward_only else torch.no_grad():
        if not forward_only:
            ref_loss = sum_loss(ref(tokens), labels, labels.numel())
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}

    # "stages": pipeline stages run one after another on the same ranks (each one
    # parallelized on its own, hidden states crossing as plain tensors).
    stages = case.get("stages") or [None]
    parts = []
    dtype = getattr(torch, case["compute_dtype"]) if case.get("compute_dtype") else None
    for stage in stages:
        part = build_part(build, cfg, parallelize, dims, job, stage, compute_dtype=dtype)
        load_full_state_dict(part, ref.state_dict())
        if cfg.enable_weight_tying and part.tok_embeddings is not None:
            assert part.output.weight is part.tok_embeddings.weight, "tie broken"
        parts.append(part)
    out = {"rope_is_plain": all(type(p.rope_cache) is torch.Tensor for p in parts)}

    def model(x):
        return run_stages(parts, x)

    if forward_only:
        with torch.no_grad():
            logits = model(tokens)
        out["logits_dtensor"] = isinstance(logits, DTensor)
        out["max_logits_diff"] = (full(logits) - ref_logits).abs().max().item()
        return out

    dp = dims.dp_size
    dp_rank = dims.dp_rank()
    per = batch // dp
    local_tokens = tokens[dp_rank * per:(dp_rank + 1) * per]
    local_labels = labels[dp_rank * per:(dp_rank + 1) * per]
    with sdpa_kernel(SDPBackend.MATH):
        logits = model(local_tokens)
        loss = sum_loss(logits, local_labels, labels.numel())
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
        grad = full(p.grad) if p.grad is not None else None
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
