"""Conformance check for generation: cached and uncached greedy decoding agree.

A model declares generation support by accepting ``cache=`` in ``forward`` (see
``titan_plugins.generate``). ``check_kv_cache`` decodes greedily twice, once
re-running the whole prefix for every token and once through the KV cache, and
fails naming the first step where the tokens differ.
"""

from __future__ import annotations

import torch
from torch import nn

from titan_plugins.generate import SamplingConfig, generate, supports_generation

__all__ = ["check_kv_cache", "supports_generation"]  # check_generation: titan_plugins.testing.conformance


def check_kv_cache(model: nn.Module, vocab_size: int, *, prompt_len: int = 6, new_tokens: int = 10,
                   batch: int = 2, seed: int = 0) -> torch.Tensor:
    """Greedy tokens with and without the cache must be identical; returns them."""
    if not supports_generation(model):
        raise AssertionError(f"{type(model).__name__}.forward takes no cache=: generation unsupported")
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, vocab_size, (batch, prompt_len), generator=g)
    device = next(model.parameters()).device
    prompt = prompt.to(device)
    uncached = generate(model, prompt, SamplingConfig(max_new_tokens=new_tokens, use_cache=False))
    cached = generate(model, prompt, SamplingConfig(max_new_tokens=new_tokens, use_cache=True))
    if not torch.equal(uncached, cached):
        step = int((uncached != cached).any(dim=0).nonzero()[0])
        raise AssertionError(
            f"{type(model).__name__}: cached greedy decoding differs from uncached at new token {step}: "
            f"{cached[:, step].tolist()} vs {uncached[:, step].tolist()}"
        )
    return cached
