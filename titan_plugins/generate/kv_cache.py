"""The key/value cache a model's attention reads and appends to during decoding.

Layout is the attention kernel's: ``[batch, kv_heads, seq, head_dim]`` per layer
(a model with latent attention may cache any pair of tensors it likes, as long as
it concatenates along dim 2). ``pos`` counts the positions already cached; the
model reads it for the rotary offset and the mask, the decode loop advances it
after each forward.
"""

from __future__ import annotations

import torch


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
    """Per-layer caches plus the number of positions already processed."""

    def __init__(self) -> None:
        self.pos = 0
        self._layers: dict[str, LayerCache] = {}

    def layer(self, name: str) -> LayerCache:
        if name not in self._layers:
            self._layers[name] = LayerCache(self)
        return self._layers[name]

    def advance(self, n: int) -> None:
        self.pos += n

    def attention_mask(self, seqlen: int, device: torch.device, chunk: int | None = None) -> torch.Tensor | None:
        """``None`` (plain causal) when nothing is cached yet, else a boolean
        ``[1, 1, seqlen, pos + seqlen]`` mask: new token i sees cached positions and
        new tokens up to itself (within its ``chunk`` of positions when given, for
        chunked local attention)."""
        if self.pos == 0 and (chunk is None or chunk >= seqlen):
            return None
        q = torch.arange(seqlen, device=device).unsqueeze(1) + self.pos
        kv = torch.arange(self.pos + seqlen, device=device).unsqueeze(0)
        mask = kv <= q
        if chunk is not None:
            mask = mask & (kv // chunk == q // chunk)
        return mask.view(1, 1, seqlen, self.pos + seqlen)
