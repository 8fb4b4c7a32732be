"""titan-plugins entry point for Qwen3. Light: imports no torch."""

from titan_plugins import Capabilities, ModelSpec, PipelineInfo, hookimpl

TITAN_PLUGINS_API = ">=1.0,<2"


@hookimpl
def titan_register_models(register):
    register(
        ModelSpec(
            name="qwen3",
            config="titan_qwen3.config:Qwen3Config",
            flavors="titan_qwen3.config:FLAVORS",
            default_flavor="debugmodel",
            build="titan_qwen3.model:build",
            parallelize="titan_qwen3.parallelize:parallelize",
            validate="titan_qwen3.config:validate",
            state_dict_adapter="titan_qwen3.state_dict_adapter:Qwen3StateDictAdapter",
            flops="titan_qwen3.config:flops",
            optimizer_hooks="titan_plugins.components.moe:build_load_balance_hooks",
            config_from_hf="titan_qwen3.hf_config:config_from_hf",
            config_to_hf="titan_qwen3.hf_config:config_to_hf",
            pipeline=PipelineInfo(
                layers_attr="layers",
                first_stage_modules=("tok_embeddings",),
                last_stage_modules=("norm", "output"),
                stage_inputs="stage_inputs",  # document ids for block_causal masks under PP
            ),
            capabilities=Capabilities(fsdp=True, tp=True, ep=True, pp=True),
            description="Qwen3 (dense and MoE, qk-norm, GQA), TorchTitan 0.2.2 numerics",
        )
    )


@hookimpl
def titan_config_searchpath():
    return "pkg://titan_qwen3.conf"
