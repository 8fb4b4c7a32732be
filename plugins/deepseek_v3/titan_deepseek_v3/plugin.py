"""titan-plugins entry point for DeepSeek-V3. Light: imports no torch.

The folder layout (config, model, parallelize, adapters) is the shared one; see
``titan_plugins.components.folder_spec``.
"""

from titan_plugins import hookimpl
from titan_plugins.components.folder_spec import folder_spec

TITAN_PLUGINS_API = ">=1.0,<2"


@hookimpl
def titan_register_models(register):
    register(folder_spec(
        "deepseek_v3", "titan_deepseek_v3", config="DeepSeekV3Config", adapter="DeepSeekV3StateDictAdapter", moe=True,
        output="lm_head", stage_inputs=None,  # one causal mask: nothing per stage
        description="DeepSeek-V3: Multi-head Latent Attention + MoE (TorchTitan's definition)",
    ))


@hookimpl
def titan_config_searchpath():
    return "pkg://titan_deepseek_v3.conf"
