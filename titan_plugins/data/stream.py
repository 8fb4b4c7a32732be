"""The streaming data modules' public names, where they were before the split
(``titan_plugins.data.stream``), for code that imports them from here.

The modules, bottom to top (each imports only those before it):
``units`` (a source cut into units, records) -> ``rows`` (the stream-per-row layout,
the resume identity) -> ``streaming`` (packing one source's streams) ->
``chat_source`` -> ``mix`` -> ``check`` (the prelaunch check); ``stateful_loader``
(the torchdata loader and its resumable state) sits beside them. Nothing in the
core imports this module.
"""

from __future__ import annotations

from titan_plugins.data.check import check_data_source
from titan_plugins.data.mix import MixedDataset, build_mix, mix_entries
from titan_plugins.data.rows import RowStream, check_identity
from titan_plugins.data.stateful_loader import StreamingLoader
from titan_plugins.data.streaming import (
    TOKENIZE_BATCH,
    StreamingTokenDataset,
    build_streaming,
)
from titan_plugins.data.units import SUFFIXES, Unit, plan_units, read_records

__all__ = [
    "SUFFIXES",
    "TOKENIZE_BATCH",
    "MixedDataset",
    "RowStream",
    "StreamingLoader",
    "StreamingTokenDataset",
    "Unit",
    "build_mix",
    "build_streaming",
    "check_data_source",
    "check_identity",
    "mix_entries",
    "plan_units",
    "read_records",
]
