"""titan-plugins entry point for Llama 4 (a shared model-folder layout). Light: no torch."""

from titan_plugins.components.folder_spec import folder_hooks

TITAN_PLUGINS_API = ">=1.1,<2"  # uses the shared decoder components (API 1.1)
titan_register_models, titan_config_searchpath = folder_hooks(
    "llama4", "titan_llama4", config="Llama4Config", adapter="Llama4StateDictAdapter", moe=True,
    cp=True,  # attention through the shared attend, RoPE through rope_rows
    description="Llama 4 (interleaved MoE, iRoPE), TorchTitan 0.2.2 numerics",
)
