"""Moved to the export room, ``titan_plugins.export`` (``hf_folder``: the writer,
``source``: reading a run's checkpoint, ``full``: titan-export and the end-of-run
export); these names stay importable from here for code written before, plugin tests
and ``hf_names`` users (docs/writing-a-plugin.md)."""

from titan_plugins.export.full import export_checkpoint, export_run
from titan_plugins.export.hf_folder import (
    MAX_SHARD,
    export_config,
    export_folder,
    folder_tokens,
    hf_names,
    make_adapter,
    write_safetensors,
)
from titan_plugins.export.source import find_checkpoint, read_dcp_model

__all__ = [
    "MAX_SHARD", "export_checkpoint", "export_config", "export_folder", "export_run", "find_checkpoint",
    "folder_tokens", "hf_names", "make_adapter", "read_dcp_model", "write_safetensors",
]
