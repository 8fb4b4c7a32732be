"""titan-plugins entry point for Llama 4. Light: imports no torch.

The folder layout (config, model, parallelize, adapters) is the shared one; see
``titan_plugins.components.folder_spec``.
"""

from titan_plugins import hookimpl
from titan_plugins.components.folder_spec import folder_spec

TITAN_PLUGINS_API = ">=1.0,<2"


@hookimpl
def titan_register_models(register):
    register(folder_spec(
        "llama4", "titan_llama4", config="Llama4Config", adapter="Llama4StateDictAdapter", moe=True,
        description="Llama 4 (interleaved MoE, iRoPE), TorchTitan 0.2.2 numerics",
    ))


@hookimpl
def titan_config_searchpath():
    return "pkg://titan_llama4.conf"
