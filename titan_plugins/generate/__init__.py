"""Sampling from a trained model: a KV cache every generation-capable model accepts,
the decode loop (greedy / temperature / top-k / top-p) and checkpoint loading for
``titan-generate``.

A model supports generation when its ``forward`` accepts ``cache=`` (a
:class:`KVCache`): with a cache it runs only the new tokens, attends to the cached
keys and values plus its own (causally), and appends its keys and values to the
cache through ``cache.layer(name).update(k, v)``; the caller advances ``cache.pos``.
"""

from titan_plugins.generate.kv_cache import KVCache, LayerCache
from titan_plugins.generate.sampling import (
    SamplingConfig,
    generate,
    sample_next,
    supports_generation,
)

__all__ = ["KVCache", "LayerCache", "SamplingConfig", "generate", "sample_next", "supports_generation"]
