"""titan-plugins entry point for DeepSeek-V3 (a shared model-folder layout). Light: no torch."""

from titan_plugins.components.folder_spec import folder_hooks

TITAN_PLUGINS_API = ">=1.1,<2"  # uses the shared decoder components (API 1.1)
titan_register_models, titan_config_searchpath = folder_hooks(
    "deepseek_v3", "titan_deepseek_v3", config="DeepSeekV3Config", adapter="DeepSeekV3StateDictAdapter", moe=True,
    output="lm_head", stage_inputs=None,  # one causal mask: nothing to hand each stage
    cp=True,  # attention through the shared attend, RoPE through rope_rows
    description="DeepSeek-V3: Multi-head Latent Attention + MoE (TorchTitan's definition)",
)
