"""titan-plugins entry point for Llama 3 (a shared model-folder layout). Light: no torch."""

from titan_plugins.components.folder_spec import folder_hooks

TITAN_PLUGINS_API = ">=1.1,<2"  # uses the shared decoder components (API 1.1)
titan_register_models, titan_config_searchpath = folder_hooks(
    "llama3", "titan_llama3", config="Llama3Config", adapter="Llama3StateDictAdapter", moe=False,
    cp=True,  # attention through the shared attend, RoPE through rope_rows
    description="Llama 3.1/3.2/3.3 (dense, GQA, llama3 RoPE scaling), TorchTitan 0.2.2 numerics",
)
