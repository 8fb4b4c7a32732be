"""The decode loop: greedy, temperature, top-k and top-p sampling, stop at EOS."""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from torch import nn

from titan_plugins.generate.kv_cache import KVCache


def supports_generation(model: nn.Module) -> bool:
    """A model declares generation support by accepting ``cache=`` in ``forward``."""
    return "cache" in inspect.signature(model.forward).parameters


@dataclass
class SamplingConfig:
    max_new_tokens: int = 64
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    seed: int = 0
    eos_id: int | None = None
    stop_ids: tuple[int, ...] = ()  # more ids that end a row (generation_config's EOS list)
    use_cache: bool = True

    def stops(self) -> list[int]:
        """Every id that ends a row: ``eos_id`` first, then ``stop_ids``."""
        out = [] if self.eos_id is None else [int(self.eos_id)]
        return out + [int(i) for i in self.stop_ids if int(i) not in out]

    def check(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens}: must be >= 1")
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature}: must be >= 0")
        if self.top_k < 0:
            raise ValueError(f"top_k={self.top_k}: must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p}: must be in (0, 1]")


def sample_next(logits: torch.Tensor, cfg: SamplingConfig, generator: torch.Generator | None) -> torch.Tensor:
    """``logits [B, V]`` -> token ids ``[B]``."""
    if cfg.temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / cfg.temperature
    if cfg.top_k:
        kth = torch.topk(logits, min(cfg.top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if cfg.top_p < 1:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        probs = sorted_logits.softmax(dim=-1)
        # Drop a token when the mass before it already reaches top_p (the first always stays).
        drop = probs.cumsum(dim=-1) - probs >= cfg.top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


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
