"""Generation: KV cache vs full recompute, sampling options, and the decode loop."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from titan_plugins.generate import SamplingConfig, generate, sample_next
from titan_plugins.testing.generation import check_kv_cache


def _tiny(name: str, **overrides):
    torch.manual_seed(0)
    if name == "qwen3":
        from titan_qwen3.config import FLAVORS
        from titan_qwen3.model import build
        cfg = dataclasses.replace(FLAVORS["debugmodel"], n_layers=2, **overrides)
    elif name == "llama4":
        from titan_llama4.config import FLAVORS
        from titan_llama4.model import build
        cfg = dataclasses.replace(FLAVORS["debugmodel"], n_layers=2, **overrides)
    else:
        from titan_deepseek_v3.config import FLAVORS
        from titan_deepseek_v3.model import build
        cfg = dataclasses.replace(FLAVORS["debugmodel"], n_layers=2, **overrides)
    model = build(cfg)
    model.init_weights()
    return model, cfg.vocab_size


CASES = {
    "qwen3": ("qwen3", {}),
    "llama4": ("llama4", {}),
    # iRoPE: layer 0 NoPE full causal, layer 1 chunked local attention crossing chunks.
    "llama4_irope": ("llama4", {"every_n_layers_nope": 2, "fixed_attn_block_size": 8}),
    "deepseek_v3": ("deepseek_v3", {}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_kv_cache_matches_recompute(case):
    name, overrides = CASES[case]
    model, vocab = _tiny(name, **overrides)
    tokens = check_kv_cache(model, vocab, new_tokens=12)
    assert tokens.shape == (2, 12)
    # Not a degenerate sequence: the check would pass trivially on a constant output.
    assert len(set(tokens.flatten().tolist())) > 1


def test_sampling_options():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]])
    g = torch.Generator().manual_seed(0)
    assert sample_next(logits, SamplingConfig(), g).item() == 1
    # top_k=1 is greedy whatever the temperature.
    assert {sample_next(logits, SamplingConfig(temperature=5.0, top_k=1), g).item() for _ in range(20)} == {1}
    # top_p keeps the smallest prefix reaching the mass: here tokens 1 and 3.
    draws = {sample_next(logits, SamplingConfig(temperature=1.0, top_p=0.8), g).item() for _ in range(200)}
    assert draws == {1, 3}
    with pytest.raises(ValueError, match="top_p=0"):
        SamplingConfig(top_p=0).check()


def test_sampling_by_uniforms_inverts_each_rows_distribution():
    """Rollouts draw every row at once from its own uniforms: over evenly spaced
    uniforms each token is drawn in proportion to its probability, tokens top-k / top-p
    remove never are, a row's draw does not depend on the others, greedy is argmax."""
    from titan_plugins.components.sampling import sample_by_uniforms

    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0], [2.0, 0.0, 0.0, 0.0]])
    n = 10_000
    u = (torch.arange(n) + 0.5) / n
    for cfg, allowed in ((SamplingConfig(temperature=1.0), [0, 1, 2, 3]),
                         (SamplingConfig(temperature=0.7, top_k=2), [1, 3]),
                         (SamplingConfig(temperature=1.0, top_p=0.8), [1, 3])):
        draws = sample_by_uniforms(logits[:1].expand(n, -1), cfg, u)
        probs = (logits[0] / cfg.temperature).masked_fill(
            ~torch.isin(torch.arange(4), torch.tensor(allowed)), float("-inf")).softmax(-1)
        torch.testing.assert_close(torch.bincount(draws, minlength=4) / n, probs, rtol=0, atol=2e-4)
    pair = sample_by_uniforms(logits, SamplingConfig(temperature=1.0), torch.tensor([0.3, 0.99]))
    alone = sample_by_uniforms(logits[1:], SamplingConfig(temperature=1.0), torch.tensor([0.99]))
    assert pair[1] == alone[0] == 3
    assert sample_by_uniforms(logits, SamplingConfig(), u[:2]).tolist() == [1, 0]


def test_generate_stops_at_eos():
    class Fixed(torch.nn.Module):  # always predicts token 3, then the EOS 2 after it
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))

        def forward(self, tokens, cache=None):
            logits = torch.zeros(*tokens.shape, 5)
            logits[..., 3] = 1.0
            logits[..., 2] = (tokens == 3).float() * 2
            return logits

    out = generate(Fixed(), torch.tensor([[0, 1]]), SamplingConfig(max_new_tokens=10, eos_id=2))
    assert out.tolist() == [[3, 2]]


def test_lm_eval_adapter_rolling_equals_windowed_scores():
    pytest.importorskip("lm_eval")
    from types import SimpleNamespace

    from titan_plugins.generate.lm_eval_adapter import TitanLM

    class Tok:  # ids are the characters' codes mod 50; EOS is 0
        eos_id = 0

        def encode(self, text):
            return [1 + ord(c) % 49 for c in text]

        def decode(self, ids):
            return "".join(chr(96 + i % 26) for i in ids)

    model, _ = _tiny("qwen3")
    req = lambda *a: SimpleNamespace(args=a)  # noqa: E731
    text = "abcdefghijklmnop"
    whole = TitanLM(model, Tok(), 64, torch.device("cpu"))
    (ll, _), = whole.loglikelihood([req("", text)])
    assert whole.loglikelihood_rolling([req(text)])[0] == pytest.approx(ll, rel=1e-5)
    # Windows of 5 tokens: each scored with at most 5 tokens of context.
    windowed = TitanLM(model, Tok(), 5, torch.device("cpu")).loglikelihood_rolling([req(text)])[0]
    assert windowed != pytest.approx(ll, rel=1e-5) and windowed < 0
    out = whole.generate_until([req("abc", {"until": ["zzzz"], "max_gen_toks": 6})])[0]
    assert isinstance(out, str) and 0 < len(out) <= 6


def test_kit_check_fails_on_a_cache_that_forgets(monkeypatch):
    from titan_plugins.generate.kv_cache import KVCache, LayerCache

    model, vocab = _tiny("qwen3")
    monkeypatch.setattr(LayerCache, "update", lambda self, k, v: (k, v))  # attends to nothing cached
    monkeypatch.setattr(KVCache, "attention_mask", lambda self, *a, **k: None)
    with pytest.raises(AssertionError, match="cached greedy decoding differs from uncached at new token"):
        check_kv_cache(model, vocab, new_tokens=12)
