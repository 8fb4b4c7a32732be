"""The key/value cache of decoding: ``titan_plugins.components.kv_cache`` (the models'
attention reads it, and the online objectives' rollouts decode with it), kept
importable here."""

from __future__ import annotations

from titan_plugins.components.kv_cache import KVCache, LayerCache

__all__ = ["KVCache", "LayerCache"]
