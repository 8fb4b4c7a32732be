"""titan-plugins entry point for Qwen3 (a shared model-folder layout). Light: no torch."""

from titan_plugins.components.folder_spec import folder_hooks

TITAN_PLUGINS_API = ">=1.1,<2"  # uses the shared decoder components (API 1.1)
titan_register_models, titan_config_searchpath = folder_hooks(
    "qwen3", "titan_qwen3", config="Qwen3Config", adapter="Qwen3StateDictAdapter", moe=True,
    cp=True,  # attention through the shared attend, RoPE through rope_rows
    description="Qwen3 (dense and MoE, qk-norm, GQA), TorchTitan 0.2.2 numerics",
)
