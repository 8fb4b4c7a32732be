"""titan-plugins entry point for Llama 3. Light: imports no torch."""

from titan_plugins import Capabilities, ModelSpec, PipelineInfo, hookimpl

TITAN_PLUGINS_API = ">=1.0,<2"


@hookimpl
def titan_register_models(register):
    register(
        ModelSpec(
            name="llama3",
            config="titan_llama3.config:Llama3Config",
            flavors="titan_llama3.config:FLAVORS",
            default_flavor="debugmodel",
            build="titan_llama3.model:build",
            parallelize="titan_llama3.parallelize:parallelize",
            validate="titan_llama3.config:validate",
            state_dict_adapter="titan_llama3.state_dict_adapter:Llama3StateDictAdapter",
            flops="titan_llama3.config:flops",
            config_from_hf="titan_llama3.hf_config:config_from_hf",
            config_to_hf="titan_llama3.hf_config:config_to_hf",
            pipeline=PipelineInfo(
                layers_attr="layers",
                first_stage_modules=("tok_embeddings",),
                last_stage_modules=("norm", "output"),
                stage_inputs="stage_inputs",  # document ids for block_causal masks under PP
            ),
            capabilities=Capabilities(fsdp=True, tp=True, ep=False, pp=True),
            description="Llama 3.1/3.2/3.3 (dense, GQA, llama3 RoPE scaling), TorchTitan 0.2.2 numerics",
        )
    )


@hookimpl
def titan_config_searchpath():
    return "pkg://titan_llama3.conf"
