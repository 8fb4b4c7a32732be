"""Moved: the PEFT folder format to ``titan_plugins.peft.folder``, the merged and
adapter exports to ``titan_plugins.export.lora``, ``adapter_shapes`` to
``titan_plugins.peft.checkpoint``; these names stay importable from here for code
written before."""

from titan_plugins.export.lora import (
    adapter_out_dir,
    base_state_dict,
    export_adapter,
    export_hf_folders,
    export_lora_live,
    export_merged,
    refuse_lora_full_export,
)
from titan_plugins.peft.checkpoint import adapter_shapes
from titan_plugins.peft.folder import ADAPTER_CONFIG, ADAPTER_WEIGHTS, read_peft_adapter, to_peft

__all__ = [
    "ADAPTER_CONFIG",
    "ADAPTER_WEIGHTS",
    "adapter_out_dir",
    "adapter_shapes",
    "base_state_dict",
    "export_adapter",
    "export_hf_folders",
    "export_lora_live",
    "export_merged",
    "read_peft_adapter",
    "refuse_lora_full_export",
    "to_peft",
]
