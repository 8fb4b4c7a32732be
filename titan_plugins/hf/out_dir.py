"""Moved to ``titan_plugins.export.out_dir`` (the export room); kept so that imports
from before keep working."""

from titan_plugins.export.out_dir import (
    KINDS,
    MARKER,
    OutDirError,
    claim_out_dir,
    export_kind,
    publish_dir,
    staging_dir,
)

__all__ = ["KINDS", "MARKER", "OutDirError", "claim_out_dir", "export_kind", "publish_dir", "staging_dir"]
