"""titan-plugins entry point for Llama 3. Light: imports no torch.

The folder layout (config, model, parallelize, adapters) is the shared one; see
``titan_plugins.components.folder_spec``.
"""

from titan_plugins import hookimpl
from titan_plugins.components.folder_spec import folder_spec

TITAN_PLUGINS_API = ">=1.0,<2"


@hookimpl
def titan_register_models(register):
    register(folder_spec(
        "llama3", "titan_llama3", config="Llama3Config", adapter="Llama3StateDictAdapter", moe=False,
        description="Llama 3.1/3.2/3.3 (dense, GQA, llama3 RoPE scaling), TorchTitan 0.2.2 numerics",
    ))


@hookimpl
def titan_config_searchpath():
    return "pkg://titan_llama3.conf"
