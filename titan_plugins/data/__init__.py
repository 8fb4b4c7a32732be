"""Training data: tokenizer, token streams, dataset builders and the loader.

Exports resolve lazily, so importing this package (as the plugin manager does
for ``titan_plugins.data.builtin``) imports neither torch nor numpy.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from titan_plugins.data.loader import DataLoader, build_dataloader, find_dataset
    from titan_plugins.data.packing import (
        PackedTokenDataset,
        ShardedStream,
        SyntheticTokenDataset,
    )
    from titan_plugins.data.sources import encode_documents
    from titan_plugins.data.tokenizer import (
        DEFAULT_TOKENIZER,
        Tokenizer,
        build_tokenizer,
        train_bpe,
    )

__all__ = [
    "DEFAULT_TOKENIZER",
    "DataLoader",
    "PackedTokenDataset",
    "ShardedStream",
    "SyntheticTokenDataset",
    "Tokenizer",
    "build_dataloader",
    "build_tokenizer",
    "encode_documents",
    "find_dataset",
    "train_bpe",
]

_MODULE_OF = {
    "DataLoader": "loader",
    "build_dataloader": "loader",
    "find_dataset": "loader",
    "PackedTokenDataset": "packing",
    "ShardedStream": "packing",
    "SyntheticTokenDataset": "packing",
    "encode_documents": "sources",
    "DEFAULT_TOKENIZER": "tokenizer",
    "Tokenizer": "tokenizer",
    "build_tokenizer": "tokenizer",
    "train_bpe": "tokenizer",
}


def __getattr__(name: str) -> Any:
    if name not in _MODULE_OF:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_MODULE_OF[name]}"), name)


def __dir__() -> list[str]:
    return list(__all__)
