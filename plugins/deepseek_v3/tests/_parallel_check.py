"""Rank code for test_parallelize.py (run through ``titan_plugins.testing.gloo.run_ranks``): the plugin's parallelize hook on gloo ranks
against the same model on one process (no trainer involved).

Every rank builds the reference model from the same seed, then the parallel model
the way the trainer does (meta build -> parallelize -> to_empty -> init_weights),
loads the reference weights into it as a full state dict, runs one forward and
backward on its data-parallel slice of a global batch, and compares the loss (summed
over data parallel) and every full gradient with the reference.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn.functional as F
from omegaconf import OmegaConf

SEQ = 16
GLOBAL_BATCH = 4

MODEL = dict(
    vocab_size=256, dim=64, n_layers=3, n_dense_layers=1, n_heads=4, kv_lora_rank=32,
    qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, ffn__hidden_dim=128,
    moe__hidden_dim=32, num_experts=4, num_shared_experts=1, top_k=2, max_seq_len=SEQ,
)

CASES = {
    "fsdp2_tp2_ep2": dict(parallelism=dict(dp_shard=2, tp=2, ep=2, etp=1), model={}),
    "fsdp2_tp2_ep2_etp2_ac_no_loss_parallel": dict(
        parallelism=dict(dp_shard=2, tp=2, ep=2, etp=2, loss_parallel=False),
        training=dict(activation_checkpoint="full"), model={},
    ),
    "fsdp2_tp2_tp_experts_no_sp_lowrank_q": dict(
        parallelism=dict(dp_shard=2, tp=2, ep=1, sequence_parallel=False), model=dict(q_lora_rank=24),
    ),
    "fsdp4_ep4": dict(parallelism=dict(dp_shard=4, ep=4), model={}),
    # Both pipeline stages of a pp=2 split on every rank, chained by hand: the TP plan on
    # a stage without tok_embeddings (and one without norm / lm_head), plain hidden
    # states across the boundary, freqs_cis a plain buffer on each stage.
    "pp2_stages_fsdp2_tp2_ep2": dict(parallelism=dict(dp_shard=2, tp=2, ep=2, etp=1), model={}, stages=2),
    "fsdp2_tp2_ep2_bf16_compute": dict(
        parallelism=dict(dp_shard=2, tp=2, ep=2, etp=1), model={}, compute_dtype=torch.bfloat16,
    ),
}


def _job(case: dict):
    from titan_plugins.config.schema import ParallelismConfig, PrecisionConfig, TrainingConfig

    par = ParallelismConfig(**case["parallelism"])
    training = TrainingConfig(seq_len=SEQ, **case.get("training", {}))
    job = OmegaConf.create({
        "parallelism": OmegaConf.structured(par),
        "training": OmegaConf.structured(training),
        "precision": OmegaConf.structured(PrecisionConfig()),
    })
    return par, job


def run_case(name: str, case: dict, world: int) -> dict:
    from titan_deepseek_v3.config import make_config, validate
    from titan_deepseek_v3.model import build
    from titan_deepseek_v3.parallelize import parallelize
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import loss_parallel

    from titan_plugins.distributed.parallel_dims import ParallelDims

    par, job = _job(case)
    dims = ParallelDims.from_config(par, world)
    dims.build_meshes("cpu")
    config = make_config(**{**MODEL, **case["model"]})
    validate(config, dims)
    dtype = case.get("compute_dtype")

    torch.manual_seed(0)
    ref = build(config)
    with torch.no_grad():
        ref.init_weights()
        for layer in ref.layers.values():  # a non-zero bias exercises biased selection
            if layer.moe_enabled:
                layer.moe.expert_bias.copy_(torch.linspace(-0.02, 0.02, config.layer.moe.num_experts))
    ref.set_compute_dtype(dtype)

    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, config.vocab_size, (GLOBAL_BATCH, SEQ), generator=g)
    labels = torch.randint(0, config.vocab_size, (GLOBAL_BATCH, SEQ), generator=g)
    n_tokens = labels.numel()
    ref_loss = F.cross_entropy(ref(tokens).float().flatten(0, 1), labels.flatten(), reduction="sum") / n_tokens
    ref_loss.backward()

    with torch.device("meta"):
        whole = build(config)
    whole.set_compute_dtype(dtype)
    n_stages = case.get("stages", 1)
    if n_stages == 1:
        parts = [whole]
    else:
        from types import SimpleNamespace

        from titan_deepseek_v3 import plugin

        specs = []
        plugin.titan_register_models(specs.append)

        from titan_plugins.distributed.pipeline import split_model

        layout = SimpleNamespace(pp=n_stages, pp_stages_per_rank=1)
        parts = [split_model(whole, specs[0].pipeline, s, layout)[0][1] for s in range(n_stages)]
        assert parts[1].tok_embeddings is None and parts[0].lm_head is None and parts[0].norm is None
    ref_sd = ref.state_dict()
    for part in parts:
        parallelize(part, dims, job)
        part.to_empty(device="cpu")
        torch.manual_seed(0)
        with torch.no_grad():
            part.init_weights(buffer_device=torch.device("cpu"))
        own = {k.replace("_checkpoint_wrapped_module.", "") for k in part.state_dict()}
        assert not any("freqs_cis" in k for k in own), own
        set_model_state_dict(
            part, {k: v for k, v in ref_sd.items() if k in own}, options=StateDictOptions(full_state_dict=True)
        )
        assert not isinstance(part.freqs_cis, DTensor)
        torch.testing.assert_close(part.freqs_cis, ref.freqs_cis, rtol=0, atol=0)

    per = GLOBAL_BATCH // dims.dp_size
    r = dims.dp_rank()
    lp = dims.tp_enabled and bool(par.loss_parallel)
    h = tokens[r * per:(r + 1) * per]
    for part in parts[:-1]:
        h = part(h)
        assert not isinstance(h, DTensor), "stages must hand over plain tensors"
    logits = parts[-1](h)
    assert isinstance(logits, DTensor) == lp, type(logits)
    with loss_parallel() if lp else contextlib.nullcontext():
        loss = F.cross_entropy(
            logits.float().flatten(0, 1), labels[r * per:(r + 1) * per].flatten(), reduction="sum"
        ) / n_tokens
        loss.backward()
    loss = (loss.full_tensor() if isinstance(loss, DTensor) else loss).detach().clone()
    if dims.dp_size > 1:
        dist.all_reduce(loss, group=dims.mesh("dp").get_group())

    fp32 = dtype is None
    torch.testing.assert_close(loss, ref_loss.detach(), rtol=1e-5 if fp32 else 1e-2, atol=1e-6 if fp32 else 1e-2)
    ref_grads = {k: p.grad for k, p in ref.named_parameters()}
    worst = 0.0
    named = [kv for part in parts for kv in part.named_parameters()]
    assert len(named) == len(ref_grads)
    for key, p in named:
        key = key.replace("_checkpoint_wrapped_module.", "")
        grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        want = ref_grads[key]
        rel = ((grad - want).norm() / want.norm().clamp_min(1e-12)).item()
        worst = max(worst, rel)
        assert rel < (2e-5 if fp32 else 5e-2), f"{name}: {key}: relative gradient error {rel:.3g}"
    return {"loss": loss.item(), "ref_loss": ref_loss.item(), "worst_grad_rel": worst}


def worker(rank: int, world: int, names: list[str]) -> list[str]:
    """One rank: the named cases in turn, one ``name: result`` line each."""
    lines = []
    for name in names:
        try:
            lines.append(f"{name}: {run_case(name, CASES[name], world)}")
        except Exception as exc:
            exc.add_note(f"case {name}")
            raise
    return lines
