"""titan-plugins entry point for Llama 4. Light: imports no torch."""

from titan_plugins import Capabilities, ModelSpec, PipelineInfo, hookimpl

TITAN_PLUGINS_API = ">=1.0,<2"


@hookimpl
def titan_register_models(register):
    register(
        ModelSpec(
            name="llama4",
            config="titan_llama4.config:Llama4Config",
            flavors="titan_llama4.config:FLAVORS",
            default_flavor="debugmodel",
            build="titan_llama4.model:build",
            parallelize="titan_llama4.parallelize:parallelize",
            validate="titan_llama4.config:validate",
            state_dict_adapter="titan_llama4.state_dict_adapter:Llama4StateDictAdapter",
            flops="titan_llama4.config:flops",
            optimizer_hooks="titan_plugins.components.moe:build_load_balance_hooks",
            config_from_hf="titan_llama4.hf_config:config_from_hf",
            config_to_hf="titan_llama4.hf_config:config_to_hf",
            pipeline=PipelineInfo(
                layers_attr="layers",
                first_stage_modules=("tok_embeddings",),
                last_stage_modules=("norm", "output"),
                stage_inputs="stage_inputs",  # document ids for block_causal masks under PP
            ),
            capabilities=Capabilities(fsdp=True, tp=True, ep=True, pp=True),
            description="Llama 4 (interleaved MoE, iRoPE), TorchTitan 0.2.2 numerics",
        )
    )


@hookimpl
def titan_config_searchpath():
    return "pkg://titan_llama4.conf"
