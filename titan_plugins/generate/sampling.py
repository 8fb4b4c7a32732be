"""The decode loop: greedy, temperature, top-k and top-p sampling, stop at EOS. The
sampling itself (``SamplingConfig``, ``sample_next``) is ``titan_plugins.components.sampling``."""

from __future__ import annotations

import inspect

import torch
from torch import nn

from titan_plugins.components.kv_cache import KVCache
from titan_plugins.components.sampling import SamplingConfig, sample_next

__all__ = ["SamplingConfig", "generate", "sample_next", "supports_generation"]


def supports_generation(model: nn.Module) -> bool:
    """A model declares generation support by accepting ``cache=`` in ``forward``."""
    return "cache" in inspect.signature(model.forward).parameters


@torch.no_grad()
def generate(model: nn.Module, prompt: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """Continue ``prompt [B, S]``; returns only the new ids ``[B, <= max_new_tokens]``.

    With ``cfg.use_cache`` the prompt runs once and each new token is one position
    through the model (its ``forward(tokens, cache=KVCache)``); without, the whole
    sequence runs again for every token (the reference the cache must reproduce).
    Stops when every row has produced ``cfg.eos_id`` or one of ``cfg.stop_ids`` (a row
    that has is filled with that id, like transformers' padding after EOS).
    """
    cfg.check()
    was_training = model.training
    model.eval()
    generator = torch.Generator(device=prompt.device).manual_seed(cfg.seed)
    cache = KVCache() if cfg.use_cache else None
    seq = prompt
    new: list[torch.Tensor] = []
    done = torch.zeros(prompt.shape[0], dtype=torch.bool, device=prompt.device)
    stops = cfg.stops()
    stop_tensor = torch.tensor(stops, dtype=prompt.dtype, device=prompt.device)
    step_in = prompt
    try:
        for _ in range(cfg.max_new_tokens):
            if cache is not None:
                logits = model(step_in, cache=cache)
                cache.advance(step_in.shape[1])
            else:
                logits = model(seq)
            nxt = sample_next(logits[:, -1, :], cfg, generator)
            if stops:
                nxt = torch.where(done, torch.full_like(nxt, stops[0]), nxt)
                done = done | torch.isin(nxt, stop_tensor)
            new.append(nxt)
            step_in = nxt.unsqueeze(1)
            seq = torch.cat([seq, step_in], dim=1)
            if stops and bool(done.all()):
                break
    finally:
        model.train(was_training)
    return torch.stack(new, dim=1)
