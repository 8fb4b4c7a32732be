"""Numerical equivalence with TorchTitan 0.2.2's DeepSeek-V3.

Both models are built the way TorchTitan's trainer builds its own: on meta, its
``update_from_config`` with the training seq_len (which sets ``max_seq_len`` and
turns grouped GEMMs off on CPU), ``to_empty``, seeded ``init_weights``. Then the
TorchTitan weights go into ours through the state-dict adapter and logits, loss
and every gradient are compared.

CPU workarounds, applied to TorchTitan only for the duration of a test:
- its router counts tokens with ``torch.histc`` on int64, which CPU lacks:
  ``torch.histc`` is patched to count integer inputs as float32 (exact for these
  small integers) and return the input's integer dtype, as CUDA's histc does;
- its attention wrapper prefers the flash kernel: both sides use the math kernel;
- top-k > 1 gathers are only repeatable with ``torch.use_deterministic_algorithms``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from titan_deepseek_v3.config import ScoreFunc, make_config, to_torchtitan
from titan_deepseek_v3.model import build
from titan_deepseek_v3.state_dict_adapter import DeepSeekV3StateDictAdapter
from torch.nn.attention import SDPBackend, sdpa_kernel

SEQ = 32

VARIANTS = {
    # TorchTitan's debugmodel as is (seq 32 < original_seq_len: no YaRN).
    "debugmodel": dict(),
    # Low-rank q, YaRN active (seq 32 > original_seq_len 16, so mscale applies),
    # sigmoid scores with route_norm/route_scale and node-limited routing.
    "lowrank_yarn_sigmoid": dict(
        dim=64, n_layers=3, n_dense_layers=1, vocab_size=256, n_heads=4,
        q_lora_rank=32, kv_lora_rank=48, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
        original_seq_len=16, mscale=1.0, ffn__hidden_dim=96, moe__hidden_dim=32,
        num_experts=8, num_shared_experts=1, top_k=2, score_func=ScoreFunc.sigmoid,
        route_norm=True, route_scale=2.5, num_expert_groups=4, num_limited_groups=2,
    ),
}


@pytest.fixture
def cpu_reference(torchtitan_ref, monkeypatch):
    original = torch.histc

    def histc(input, *args, **kwargs):
        if input.is_floating_point():
            return original(input, *args, **kwargs)
        return original(input.float(), *args, **kwargs).to(input.dtype)

    monkeypatch.setattr(torch, "histc", histc)
    monkeypatch.setattr(
        torchtitan_ref["attention"].ScaledDotProductAttentionWrapper, "sdpa_backends", [SDPBackend.MATH]
    )
    was_deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    yield torchtitan_ref
    torch.use_deterministic_algorithms(was_deterministic)


def build_pair(ref, overrides):
    config = make_config(max_seq_len=SEQ, **overrides)
    kwargs = to_torchtitan(config)
    kwargs["moe_args"] = ref["MoEArgs"](**kwargs["moe_args"])
    kwargs["max_seq_len"] = 4096 * 4  # TorchTitan's default; its trainer then sets seq_len
    args = ref["Args"](**kwargs)
    job = ref["JobConfig"]()
    job.training.seq_len = SEQ
    args.update_from_config(job)
    assert args.max_seq_len == config.max_seq_len == SEQ
    with torch.device("meta"):
        theirs = ref["model"].DeepSeekV3Model(args)
        ours = build(config)
    for model in (theirs, ours):
        model.to_empty(device="cpu")
        with torch.no_grad():
            torch.manual_seed(0)
            model.init_weights(buffer_device=torch.device("cpu"))
    return config, theirs, ours


def run(model, tokens, labels):
    with sdpa_kernel(SDPBackend.MATH):
        logits = model(tokens)
    loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())
    loss.backward()
    return logits, loss


def batch(vocab_size):
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, vocab_size, (2, SEQ), generator=g), torch.randint(0, vocab_size, (2, SEQ), generator=g)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_fp32_logits_loss_and_grads_match(cpu_reference, variant):
    config, theirs, ours = build_pair(cpu_reference, VARIANTS[variant])
    adapter = DeepSeekV3StateDictAdapter(config)

    # Same seed, same scheme: the initial weights agree before anything is loaded.
    init_theirs, init_ours = theirs.state_dict(), adapter.to_torchtitan(ours.state_dict())
    assert init_theirs.keys() == init_ours.keys()
    for key in init_theirs:
        torch.testing.assert_close(init_ours[key], init_theirs[key], rtol=0, atol=0, msg=key)

    # Their weights (perturbed, so nothing relies on the shared seed) into ours.
    with torch.no_grad():
        for p in theirs.parameters():
            p.add_(torch.randn_like(p) * 1e-3)
        theirs.layers[str(config.n_layers - 1)].moe.expert_bias.copy_(
            torch.linspace(-0.01, 0.01, config.layer.moe.num_experts)
        )
    ours.load_state_dict(adapter.from_torchtitan(theirs.state_dict()), strict=True)

    tokens, labels = batch(config.vocab_size)
    logits_t, loss_t = run(theirs, tokens, labels)
    logits_o, loss_o = run(ours, tokens, labels)
    assert logits_o.dtype == torch.float32
    diff = (logits_o - logits_t).abs().max().item()
    print(f"{variant}: fp32 max |logits diff| = {diff:.3g}, loss {loss_o.item():.6f} vs {loss_t.item():.6f}")
    torch.testing.assert_close(logits_o, logits_t, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(loss_o, loss_t, rtol=1e-6, atol=1e-6)
    grads_t = {k: p.grad for k, p in theirs.named_parameters()}
    grads_o = adapter.to_torchtitan({k: p.grad for k, p in ours.named_parameters()})
    assert grads_t.keys() == grads_o.keys()
    for key, g in grads_t.items():
        assert g is not None and grads_o[key] is not None, key
        torch.testing.assert_close(grads_o[key], g, rtol=1e-5, atol=1e-6, msg=key)
    # Both count the same routing decisions for load balancing.
    for i in range(config.n_dense_layers, config.n_layers):
        torch.testing.assert_close(
            ours.layers[str(i)].moe.tokens_per_expert, theirs.layers[str(i)].moe.tokens_per_expert
        )


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_bf16_compute_matches_torchtitan_in_bf16(cpu_reference, variant):
    """Ours computes in bf16 with fp32 weights; TorchTitan runs with its parameters
    cast to bf16 (what FSDP's bf16 param_dtype hands it; buffers stay as they are)."""
    config, theirs, ours = build_pair(cpu_reference, VARIANTS[variant])
    adapter = DeepSeekV3StateDictAdapter(config)
    ours.load_state_dict(adapter.from_torchtitan(theirs.state_dict()), strict=True)
    with torch.no_grad():
        for p in theirs.parameters():
            p.data = p.data.to(torch.bfloat16)
    ours.set_compute_dtype(torch.bfloat16)

    tokens, labels = batch(config.vocab_size)
    logits_t, loss_t = run(theirs, tokens, labels)
    logits_o, loss_o = run(ours, tokens, labels)
    assert logits_o.dtype == torch.bfloat16
    assert all(p.dtype == torch.float32 for p in ours.parameters())
    assert all(p.grad.dtype == torch.float32 for p in ours.parameters())
    diff = (logits_o.float() - logits_t.float()).abs().max().item()
    print(f"{variant}: bf16 max |logits diff| = {diff:.3g}, loss {loss_o.item():.6f} vs {loss_t.item():.6f}")
    torch.testing.assert_close(logits_o.float(), logits_t.float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(loss_o, loss_t, rtol=1e-3, atol=1e-3)
    grads_t = {k: p.grad.float() for k, p in theirs.named_parameters()}
    grads_o = adapter.to_torchtitan({k: p.grad for k, p in ours.named_parameters()})
    for key, g in grads_t.items():
        rel = ((grads_o[key] - g).norm() / g.norm().clamp_min(1e-12)).item()
        assert rel < 2e-2, f"{key}: relative gradient error {rel:.3g}"


def test_flavors_match_torchtitan(torchtitan_ref):
    """Our flavors carry TorchTitan's numbers (max_seq_len aside: its trainer sets it)."""
    from titan_deepseek_v3.config import FLAVORS, from_torchtitan

    theirs = torchtitan_ref["package"].deepseekv3_args
    for name, ours in FLAVORS.items():
        mapped = from_torchtitan(theirs[name])
        mapped.max_seq_len = ours.max_seq_len
        assert mapped == ours, name
