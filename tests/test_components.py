"""The shared decoder components (docs/components.md): RoPE layouts and scalings, the
decoder a third party builds from them (the guide's own example, run as written), the
TP plan pieces, the validation checks and the model-folder spec. In-process, tiny shapes."""

from __future__ import annotations

import dataclasses
import re
import sys
import types
from pathlib import Path

import pytest
import torch

from titan_plugins.components import rope
from titan_plugins.components.rope_config import RoPEScaling
from titan_plugins.errors import ConfigError

GUIDE = Path(__file__).resolve().parents[1] / "docs" / "components.md"


def _guide_module() -> types.ModuleType:
    """The guide's complete-decoder example, executed as a module."""
    blocks = re.findall(r"```python\n(.*?)```", GUIDE.read_text(), flags=re.S)
    source = next(b for b in blocks if "class TinyModel(Decoder)" in b)
    module = types.ModuleType("components_guide_example")
    sys.modules[module.__name__] = module  # dataclasses resolve annotations through it
    exec(compile(source, str(GUIDE), "exec"), module.__dict__)
    return module


# ----------------------------------------------------------------------------- rope
def test_rotate_half_is_the_complex_layout_with_halves_for_pairs():
    # The two layouts rotate the same (x_j, x_{j+d/2}) / (x_{2j}, x_{2j+1}) pairs by the
    # same angles: permuting the head dims maps one onto the other.
    head_dim, seq = 8, 5
    x = torch.randn(2, seq, 3, head_dim)
    perm = torch.cat([torch.arange(0, head_dim, 2), torch.arange(1, head_dim, 2)])  # pairs -> halves
    complex_out = rope.apply_rotary_emb(x, rope.precompute_freqs_cis(head_dim, seq, 10000.0))
    half_q, _ = rope.apply_rotary(x[..., perm], x[..., perm], rope.rope_cache(head_dim, seq, 10000.0))
    torch.testing.assert_close(half_q, complex_out[..., perm], rtol=1e-6, atol=1e-6)


def test_llama3_scaling_keeps_short_wavelengths_and_divides_long_ones():
    freqs = rope.rope_frequencies(64, 500000.0)
    scaled = rope.llama3_scaled(freqs, RoPEScaling(scaling_factor=8.0))
    assert torch.equal(scaled[:4], freqs[:4])  # high frequencies: kept
    torch.testing.assert_close(scaled[-4:], freqs[-4:] / 8.0)  # beyond the original context
    assert not torch.isnan(rope.llama3_scaled(freqs, RoPEScaling(high_freq_factor=1.0))).any()  # empty band
    off = rope.precompute_freqs_cis(64, 16, 500000.0, RoPEScaling(enabled=False))
    assert torch.equal(off, rope.precompute_freqs_cis(64, 16, 500000.0))


def test_yarn_off_is_plain_rope_and_on_interpolates_low_frequencies():
    kw = dict(factor=40.0, original_seq_len=4096, beta_fast=32, beta_slow=1, attention_factor=1.5)
    plain = rope.yarn_freqs_cis(16, 32, 10000.0, enabled=False, **kw)
    torch.testing.assert_close(plain, rope.precompute_freqs_cis(16, 32, 10000.0), rtol=0, atol=0)
    yarn = rope.yarn_freqs_cis(16, 32, 10000.0, enabled=True, **kw)
    torch.testing.assert_close(yarn.abs(), torch.full_like(yarn.abs(), 1.5))  # HF's attention_factor
    torch.testing.assert_close(yarn.angle()[:, 0], plain.angle()[:, 0])  # fastest dimension kept
    torch.testing.assert_close(yarn.angle()[1, -1], plain.angle()[1, -1] / 40.0)  # slowest interpolated


def test_rotary_tables_refuse_a_longer_sequence():
    with pytest.raises(ValueError, match="model.max_seq_len=4"):
        rope.apply_rotary_emb(torch.zeros(1, 5, 1, 4), rope.precompute_freqs_cis(4, 4, 10000.0))


# ---------------------------------------------------------- the guide's decoder
def test_guide_decoder_trains_cuts_into_stages_and_decodes():
    from titan_plugins.generate.kv_cache import KVCache

    guide = _guide_module()
    cfg = guide.TinyConfig()
    with torch.device("meta"):
        model = guide.build(cfg)
    assert [n for n, _ in model.named_parameters()][:7] == [
        "tok_embeddings.weight", "layers.0.attention.wq.weight", "layers.0.attention.wk.weight",
        "layers.0.attention.wv.weight", "layers.0.attention.wo.weight", "layers.0.feed_forward.w1.weight",
        "layers.0.feed_forward.w2.weight",
    ]
    assert not any("freqs_cis" in k for k in model.state_dict())
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.init_weights(torch.device("cpu"))
    tokens = torch.randint(0, cfg.vocab_size, (2, 12))
    logits = model(tokens)
    assert logits.shape == (2, 12, cfg.vocab_size)
    logits.sum().backward()
    assert all(p.grad is not None for p in model.parameters())

    # Two pipeline stages compose to the whole model.
    first, last = guide.build(cfg), guide.build(cfg)
    first.load_state_dict(model.state_dict()), last.load_state_dict(model.state_dict())
    del first.layers["1"], last.layers["0"]
    first.norm = first.output = last.tok_embeddings = None
    with torch.no_grad():
        torch.testing.assert_close(last(first(tokens)), logits.detach(), rtol=0, atol=0)

    # Decoding a prefix then one token at a time equals the full forward.
    cache = KVCache()
    with torch.no_grad():
        steps = [model(tokens[:, :8], cache=cache)]
        cache.advance(8)
        for i in range(8, 12):
            steps.append(model(tokens[:, i : i + 1], cache=cache))
            cache.advance(1)
    torch.testing.assert_close(torch.cat(steps, dim=1), logits.detach(), rtol=1e-5, atol=1e-5)


def test_decoder_refuses_a_sequence_longer_than_its_rotary_table():
    guide = _guide_module()
    model = guide.build(dataclasses.replace(guide.TinyConfig(), max_seq_len=8))
    with pytest.raises(ValueError, match="sequence length 9 exceeds model.max_seq_len=8"):
        model(torch.zeros(1, 9, dtype=torch.long))


def test_gqa_init_is_torchtitans_order():
    from titan_plugins.components.gqa import GQAttention
    from titan_plugins.components.init import trunc_normal_

    attn = GQAttention(16, 4, 2, 4, bias=True, qk_norm_eps=1e-6)
    torch.manual_seed(3)
    attn.init_weights(0.01)
    torch.manual_seed(3)
    want = [torch.empty(16, 16), torch.empty(8, 16), torch.empty(8, 16), torch.empty(16, 16)]
    for w, std in zip(want, (0.02, 0.02, 0.02, 0.01)):
        trunc_normal_(w, std=std)
    for lin, w in zip((attn.wq, attn.wk, attn.wv, attn.wo), want):
        assert torch.equal(lin.weight, w) and not lin.bias.any()
    assert torch.equal(attn.q_norm.weight, torch.ones(4))


# ------------------------------------------------------------------ plans
def test_block_plans_name_the_shared_modules():
    from titan_plugins.distributed import tensor_parallel as tpp

    attention = tpp.gqa_attention_plan(True, None, None)
    assert list(attention) == [
        "attention", "attention.wq", "attention.wk", "attention.wv", "attention.q_norm",
        "attention.k_norm", "attention.inner_attention", "attention.wo",
    ]
    dense = tpp.decoder_block_plan(True, attention, feed_forward=True)
    moe = tpp.decoder_block_plan(True, attention, feed_forward=False)
    assert set(dense) - set(moe) == {"feed_forward", "feed_forward.w1", "feed_forward.w2", "feed_forward.w3"}
    assert {"attention_norm", "ffn_norm"} <= set(moe)


# -------------------------------------------------------------- validation
def test_validation_checks_name_both_numbers():
    from titan_plugins.components import validation as checks

    assert checks.degree({"tp": None}, "tp") == 1 and checks.degree(types.SimpleNamespace(tp=4), "tp") == 4
    with pytest.raises(ConfigError, match=r"^model.n_heads=6 is not divisible by parallelism.tp=4$"):
        checks.check_divisible([("n_heads", 6)], 4)
    with pytest.raises(ConfigError, match=r"model.n_layers=2 is fewer than the 4 pipeline stages"):
        checks.check_pipeline({"pp": 2, "pp_stages_per_rank": 2}, n_layers=2)
    with pytest.raises(ConfigError, match="enable_weight_tying=true cannot run with parallelism.pp=2"):
        checks.check_pipeline({"pp": 2}, n_layers=8, tied=True)
    checks.check_pipeline({"pp": 2}, n_layers=2)


# ------------------------------------------------------------ folder spec
@pytest.mark.parametrize("name", ["qwen3", "llama3", "llama4", "deepseek_v3"])
def test_first_party_folder_specs_resolve(name):
    from titan_plugins.plugins import get_plugin_manager

    spec = get_plugin_manager().get_model(name)
    for attr in ("config", "flavors", "build", "parallelize", "validate", "state_dict_adapter", "flops",
                 "config_from_hf", "config_to_hf", "optimizer_hooks"):
        assert spec.load(attr) is not None or (attr == "optimizer_hooks" and name == "llama3"), attr
    assert spec.default_flavor in spec.load("flavors")


# ------------------------------------------------------------------ sinks
def _hf_sink_attention(q, k, v, sinks, mask, scale):
    """transformers' eager GPT-OSS attention (the reference), on (batch, heads, seq, dim)."""
    gpt_oss = pytest.importorskip("transformers.models.gpt_oss.modeling_gpt_oss")
    module = types.SimpleNamespace(sinks=sinks, num_key_value_groups=q.shape[1] // k.shape[1], training=False)
    additive = torch.zeros(mask.shape, dtype=q.dtype).masked_fill(~mask, float("-inf"))
    out, _ = gpt_oss.eager_attention_forward(module, q, k, v, additive, scale)
    return out.transpose(1, 2)


def test_sink_kernel_matches_transformers_gpt_oss_and_trains_its_sinks():
    from titan_plugins.components.gqa import SinkKernel

    torch.manual_seed(0)
    kernel = SinkKernel("sdpa", n_heads=4)
    kernel.init_weights(1.0)
    q, k, v = torch.randn(2, 4, 6, 8), torch.randn(2, 2, 6, 8), torch.randn(2, 2, 6, 8)
    causal = torch.ones(6, 6, dtype=torch.bool).tril()
    out = kernel(q, k, v, None)
    want = _hf_sink_attention(q, k, v, kernel.sinks.detach(), causal, 8**-0.5)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
    # The last two queries against all six keys (decoding with a cache): causal offset.
    torch.testing.assert_close(kernel(q[:, :, 4:], k, v, None), want[:, :, 4:], rtol=1e-5, atol=1e-6)
    # A very negative sink takes no mass: plain causal attention.
    with torch.no_grad():
        kernel.sinks.fill_(-1e4)
    plain = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(kernel(q, k, v, None), plain, rtol=1e-5, atol=1e-6)
    kernel.init_weights(1.0)
    kernel(q, k, v, None).sum().backward()
    assert kernel.sinks.grad is not None and kernel.sinks.grad.abs().sum() > 0


def test_sink_kernel_flex_path_equals_the_eager_one():
    from titan_plugins.components.attention_masks import block_mask, dense_mask
    from titan_plugins.components.gqa import SinkKernel

    torch.manual_seed(1)
    kernel = SinkKernel("flex", n_heads=2)
    kernel.init_weights(1.0)
    q, k, v = (torch.randn(1, 2, 16, 8) for _ in range(3))
    doc = torch.tensor([[0] * 7 + [1] * 9])
    with torch.no_grad():
        flex = kernel(q, k, v, block_mask(doc, 16, None, q.device))
        eager = kernel(q, k, v, dense_mask(doc, 16, None, q.device))
    torch.testing.assert_close(flex, eager, rtol=1e-5, atol=1e-5)


class _SinkAttention(torch.nn.Module):
    """A block-shaped parent for the TP plan: ``attention`` with sinks, rotary-free."""

    def __init__(self):
        from titan_plugins.components.gqa import GQAttention, SinkKernel

        super().__init__()

        class Attention(GQAttention):
            def forward(self, x, rope, mask):
                q, k, v = (t.transpose(1, 2) for t in self.project(x))
                return self.out(self.inner_attention(q, k, v, mask).transpose(1, 2))

        self.attention = Attention(16, 4, 2, 4)
        self.attention.inner_attention = SinkKernel("sdpa", n_heads=4)

    def forward(self, x):
        return self.attention(x, None, None)


def _sink_tp_rank(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from titan_plugins.distributed import tensor_parallel as tpp
    from titan_plugins.testing.model_parts import full, load_full_state_dict

    torch.manual_seed(0)
    ref = _SinkAttention()
    ref.attention.inner_attention.init_weights(1.0)
    x = torch.randn(2, 6, 16)
    ref(x).sum().backward()
    with torch.device("meta"):
        model = _SinkAttention()
    tpp.apply_tp_plan(model, init_device_mesh("cpu", (world,)), tpp.gqa_attention_plan(False, None, None))
    model.to_empty(device="cpu")
    load_full_state_dict(model, ref.state_dict())
    out = model(x)
    full(out).sum().backward()
    sinks = model.attention.inner_attention.sinks
    return {"out": (full(out) - ref(x).detach()).abs().max().item(), "local_sinks": sinks.to_local().shape[0],
            "sink_grad": (full(sinks.grad) - ref.attention.inner_attention.sinks.grad).abs().max().item()}


@pytest.mark.slow
def test_sinks_shard_with_the_heads_under_tp():
    from titan_plugins.testing.gloo import run_ranks

    got = run_ranks(_sink_tp_rank, 2, timeout=180)[0]
    assert got["local_sinks"] == 2  # 4 heads over tp=2
    assert got["out"] < 1e-5 and got["sink_grad"] < 1e-5, got
