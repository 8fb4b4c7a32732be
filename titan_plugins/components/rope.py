"""Rotary position embeddings: default, Llama 3.1 scaling and YaRN, in TorchTitan's two layouts.

- Complex, adjacent pairs (TorchTitan's Llama 3/4 and DeepSeek-V3): a complex64 table
  ``(max_seq_len, rot_dim // 2)`` from ``precompute_freqs_cis`` (default or Llama 3.1
  scaling) or ``yarn_freqs_cis``, applied with ``apply_rotary_emb``.
- Real, rotate-half (TorchTitan's Qwen3, Hugging Face's layout): a ``(max_seq_len,
  2 * head_dim)`` cos|sin table from ``rope_cache``, applied with ``apply_rotary``.

The tables are plain tensors, meant for non-persistent buffers a model rebuilds in
``init_weights`` (never in ``state_dict()``). Every function here computes exactly as
its TorchTitan v0.2.2 counterpart (same ops, same order), so a model built on them
matches TorchTitan bitwise.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from titan_plugins.components.rope_config import RoPEScaling

__all__ = [
    "apply_rotary",
    "apply_rotary_emb",
    "llama3_scaled",
    "precompute_freqs_cis",
    "rope_cache",
    "rope_frequencies",
    "yarn_freqs_cis",
]


def rope_frequencies(head_dim: int, theta: float, device: torch.device | str | None = None) -> torch.Tensor:
    """float32 ``(head_dim // 2,)``: ``theta ** (-2i / head_dim)``, the unscaled frequencies."""
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device)[: head_dim // 2].float() / head_dim))


def llama3_scaled(freqs: torch.Tensor, scaling: RoPEScaling) -> torch.Tensor:
    """Llama 3.1's scaling: wavelengths beyond ``original_max_position_embeddings /
    low_freq_factor`` divided by ``scaling_factor``, those below ``/ high_freq_factor``
    kept, the band in between interpolated. With ``low == high`` the band is empty (the
    0/0 it computes is discarded)."""
    factor, orig = scaling.scaling_factor, scaling.original_max_position_embeddings
    low, high = scaling.low_freq_factor, scaling.high_freq_factor
    wavelen = 2 * math.pi / freqs
    freqs = torch.where(wavelen > orig / low, freqs / factor, freqs)
    smooth = (orig / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * freqs / factor + smooth * freqs
    medium = ~(wavelen < orig / high) * ~(wavelen > orig / low)
    return torch.where(medium, smoothed, freqs)


def precompute_freqs_cis(head_dim: int, end: int, theta: float, scaling: RoPEScaling | None = None) -> torch.Tensor:
    """complex64 ``(end, head_dim // 2)`` (TorchTitan's ``precompute_freqs_cis``), Llama
    3.1-scaled when ``scaling`` is given and enabled. Builds on the current default
    device (``with torch.device(...)``)."""
    freqs = rope_frequencies(head_dim, theta)
    if scaling is not None and scaling.enabled:
        freqs = llama3_scaled(freqs, scaling)
    angles = torch.outer(torch.arange(end, device=freqs.device), freqs).float()
    return torch.polar(torch.ones_like(angles), angles)


def yarn_freqs_cis(
    dim: int, end: int, theta: float, *, enabled: bool, factor: float, original_seq_len: int,
    beta_fast: float, beta_slow: float, attention_factor: float = 1.0,
) -> torch.Tensor:
    """complex64 ``(end, dim // 2)``, YaRN-scaled when ``enabled`` (DeepSeek-V3's reference
    code): dimensions rotating fewer than ``beta_slow`` times over the original context
    are interpolated by ``1 / factor``, those rotating more than ``beta_fast`` times
    kept, a linear ramp in between. ``attention_factor`` scales the magnitude (Hugging
    Face's YaRN scales cos/sin by it; 1.0 in TorchTitan)."""
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    if enabled:
        def correction_dim(rotations: float) -> float:
            return dim * math.log(original_seq_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

        low = max(math.floor(correction_dim(beta_fast)), 0)
        high = min(math.ceil(correction_dim(beta_slow)), dim - 1)
        if low == high:
            high += 0.001
        ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
        smooth = 1 - ramp
        freqs = freqs / factor * (1 - smooth) + freqs * smooth
    freqs = torch.outer(torch.arange(end), freqs)
    return torch.polar(torch.full_like(freqs, attention_factor if enabled else 1.0), freqs)


def apply_rotary_emb(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``(batch, seq, heads, rot_dim)`` by the first ``seq`` rows of a complex
    table, adjacent pairs as complex numbers (TorchTitan's layout); ``x``'s dtype kept."""
    seqlen = x.shape[1]
    if seqlen > freqs_cis.shape[0]:
        raise ValueError(
            f"sequence length {seqlen} exceeds model.max_seq_len={freqs_cis.shape[0]} "
            "(the rotary table's length); raise model.max_seq_len"
        )
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    out = torch.view_as_real(xc * freqs_cis[:seqlen].view(1, seqlen, 1, -1)).flatten(3)
    return out.type_as(x)


def rope_cache(head_dim: int, max_seq_len: int, theta: float, device: torch.device | str | None = None) -> torch.Tensor:
    """float32 ``(max_seq_len, 2 * head_dim)``: cos then sin of the rotation angles, each
    repeated over both halves of the head (the rotate-half convention)."""
    inv_freq = rope_frequencies(head_dim, theta, device)
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float32, device=device), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return torch.cat([angles.cos(), angles.sin()], dim=-1)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(xq: torch.Tensor, xk: torch.Tensor, cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate ``(batch, seq, heads, head_dim)`` queries and keys by position with a
    ``rope_cache`` table (rotate-half), in their own dtype."""
    _, seqlen, _, head_dim = xq.shape
    if seqlen > cache.shape[0]:
        raise ValueError(
            f"sequence length {seqlen} exceeds the rotary cache (model.max_seq_len={cache.shape[0]})"
        )
    cache = cache[:seqlen].view(1, seqlen, 1, 2 * head_dim)
    cos = cache[..., :head_dim].to(xq.dtype)
    sin = cache[..., head_dim:].to(xq.dtype)
    xq_out = xq * cos + _rotate_half(xq) * sin
    xk_out = xk * cos + _rotate_half(xk) * sin
    return xq_out.type_as(xq), xk_out.type_as(xk)
