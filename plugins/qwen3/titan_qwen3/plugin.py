"""titan-plugins entry point for Qwen3. Light: imports no torch.

The folder layout (config, model, parallelize, adapters) is the shared one; see
``titan_plugins.components.folder_spec``.
"""

from titan_plugins import hookimpl
from titan_plugins.components.folder_spec import folder_spec

TITAN_PLUGINS_API = ">=1.0,<2"


@hookimpl
def titan_register_models(register):
    register(folder_spec(
        "qwen3", "titan_qwen3", config="Qwen3Config", adapter="Qwen3StateDictAdapter", moe=True,
        description="Qwen3 (dense and MoE, qk-norm, GQA), TorchTitan 0.2.2 numerics",
    ))


@hookimpl
def titan_config_searchpath():
    return "pkg://titan_qwen3.conf"
