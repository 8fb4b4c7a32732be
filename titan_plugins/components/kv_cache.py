"""The key/value cache a model's attention reads and appends to during decoding.

Layout is the attention kernel's: ``[batch, kv_heads, seq, head_dim]`` per layer
(a model with latent attention may cache any pair of tensors it likes, as long as
it concatenates along dim 2). ``pos`` counts the positions already cached; the
model reads it for the rotary offset and the mask, the decode loop advances it
after each forward.

A batch of prompts of different lengths decodes together left-padded: ``pad``
(``[batch, prompt_len]``, True on padding) keeps every real token from attending to
the padding. Each row's positions are then offset by its padding, which a model
whose attention sees only relative positions (rotary embeddings) does not notice.
It lives with the components (not in ``generate/``) because the models' attention
reads it and the online objectives' rollouts decode with it.
"""

from __future__ import annotations

import torch

__all__ = ["KVCache", "LayerCache"]


class LayerCache:
    """One attention layer's cached keys and values."""

    def __init__(self, parent: KVCache) -> None:
        self.parent = parent
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append the new positions (dim 2) and return everything cached so far."""
        if self.k is None:
            self.k, self.v = k, v
        else:
            self.k = torch.cat([self.k, k], dim=2)
            self.v = torch.cat([self.v, v], dim=2)
        return self.k, self.v

    def attention_mask(self, seqlen: int, device: torch.device, chunk: int | None = None) -> torch.Tensor | None:
        return self.parent.attention_mask(seqlen, device, chunk)


class KVCache:
    """Per-layer caches plus the number of positions already processed; ``pad``
    (optional, ``[batch, prompt_len]`` bool) marks the prompts' left padding."""

    def __init__(self, pad: torch.Tensor | None = None) -> None:
        self.pos = 0
        self.pad = pad if pad is not None and bool(pad.any()) else None
        self._layers: dict[str, LayerCache] = {}

    def layer(self, name: str) -> LayerCache:
        if name not in self._layers:
            self._layers[name] = LayerCache(self)
        return self._layers[name]

    def advance(self, n: int) -> None:
        self.pos += n

    def attention_mask(self, seqlen: int, device: torch.device, chunk: int | None = None) -> torch.Tensor | None:
        """``None`` (plain causal) when nothing is cached yet and nothing is padded, else
        a boolean ``[1 or batch, 1, seqlen, pos + seqlen]`` mask: new token i sees cached
        positions and new tokens up to itself (within its ``chunk`` of positions when
        given, for chunked local attention), never a padding position; a padding
        position sees itself (a row with nothing to attend to would be NaN, and a NaN
        value times a zero weight is still NaN for the rows that mask it)."""
        if self.pos == 0 and (chunk is None or chunk >= seqlen) and self.pad is None:
            return None
        q = torch.arange(seqlen, device=device).unsqueeze(1) + self.pos
        kv = torch.arange(self.pos + seqlen, device=device).unsqueeze(0)
        mask = kv <= q
        if chunk is not None:
            mask = mask & (kv // chunk == q // chunk)
        if self.pad is None:
            return mask.view(1, 1, seqlen, self.pos + seqlen)
        pad = self.pad.to(device)
        total = self.pos + seqlen
        keys_pad = torch.zeros(pad.shape[0], total, dtype=torch.bool, device=device)
        width = min(pad.shape[1], total)
        keys_pad[:, :width] = pad[:, :width]
        batch = mask.unsqueeze(0) & ~keys_pad.unsqueeze(1)  # [batch, seqlen, total]
        queries_pad = keys_pad[:, self.pos:total].unsqueeze(-1) & (kv == q).unsqueeze(0)
        return (batch | queries_pad).unsqueeze(1)
