"""Choosing the next token from logits: greedy, temperature, top-k and top-p (nucleus)
sampling, in transformers' order (temperature, then top-k, then top-p). It lives with
the components so that both ``titan-generate`` (``titan_plugins.generate``) and the
online objectives' rollouts (``titan_plugins.objectives``) sample with it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["SamplingConfig", "sample_by_uniforms", "sample_next"]


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


def _probs(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """The sampling distribution ``[B, V]`` of ``logits [B, V]`` (temperature > 0)."""
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
    return logits.softmax(dim=-1)


def sample_next(logits: torch.Tensor, cfg: SamplingConfig, generator: torch.Generator | None) -> torch.Tensor:
    """``logits [B, V]`` -> token ids ``[B]``."""
    if cfg.temperature == 0:
        return logits.argmax(dim=-1)
    return torch.multinomial(_probs(logits, cfg), 1, generator=generator).squeeze(-1)


def sample_by_uniforms(logits: torch.Tensor, cfg: SamplingConfig, uniforms: torch.Tensor) -> torch.Tensor:
    """``logits [B, V]`` -> token ids ``[B]``, row ``b`` drawn by inverting its
    distribution's CDF at ``uniforms[b]`` (in [0, 1)). One batched draw whose rows each
    follow their own random stream: a row samples the same tokens whatever rows share
    its batch, without a generator call per row and token."""
    if cfg.temperature == 0:
        return logits.argmax(dim=-1)
    cdf = _probs(logits, cfg).cumsum(dim=-1)
    # scaled by the row's total: the float sum may end just below 1
    u = (uniforms.to(cdf.dtype) * cdf[:, -1]).unsqueeze(-1)
    # the first token whose CDF exceeds u; zero-probability tokens never are (their CDF
    # step is empty), so masked tokens cannot be drawn
    return torch.searchsorted(cdf, u, right=True).squeeze(-1).clamp_(max=logits.shape[-1] - 1)
