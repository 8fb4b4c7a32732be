"""titan-plugins entry point for DeepSeek-V3. Light: imports no torch."""

from titan_plugins import Capabilities, ModelSpec, PipelineInfo, hookimpl

TITAN_PLUGINS_API = ">=1.0,<2"


@hookimpl
def titan_register_models(register):
    register(
        ModelSpec(
            name="deepseek_v3",
            config="titan_deepseek_v3.config:DeepSeekV3Config",
            flavors="titan_deepseek_v3.config:FLAVORS",
            default_flavor="debugmodel",
            build="titan_deepseek_v3.model:build",
            parallelize="titan_deepseek_v3.parallelize:parallelize",
            validate="titan_deepseek_v3.config:validate",
            state_dict_adapter="titan_deepseek_v3.state_dict_adapter:DeepSeekV3StateDictAdapter",
            flops="titan_deepseek_v3.config:flops",
            optimizer_hooks="titan_plugins.components.moe:build_load_balance_hooks",
            config_from_hf="titan_deepseek_v3.hf_config:config_from_hf",
            config_to_hf="titan_deepseek_v3.hf_config:config_to_hf",
            pipeline=PipelineInfo(
                layers_attr="layers",
                first_stage_modules=("tok_embeddings",),
                last_stage_modules=("norm", "lm_head"),
            ),
            capabilities=Capabilities(fsdp=True, tp=True, ep=True, pp=True),
            description="DeepSeek-V3: Multi-head Latent Attention + MoE (TorchTitan's definition)",
        )
    )


@hookimpl
def titan_config_searchpath():
    return "pkg://titan_deepseek_v3.conf"
