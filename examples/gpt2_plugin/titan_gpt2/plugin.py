"""titan-plugins entry point for the GPT-2 example. Light: imports no torch."""

from titan_plugins import Capabilities, ModelSpec, PipelineInfo, hookimpl

TITAN_PLUGINS_API = ">=1.1,<2"  # its parallelize hook is parallelize_decoder (API 1.1)


@hookimpl
def titan_register_models(register):
    register(
        ModelSpec(
            name="gpt2",
            config="titan_gpt2.config:GPT2Config",
            flavors="titan_gpt2.config:FLAVORS",
            build="titan_gpt2.model:build",
            parallelize="titan_gpt2.parallelize:parallelize",
            validate="titan_gpt2.config:validate",
            flops="titan_gpt2.config:flops",
            state_dict_adapter="titan_gpt2.hf:GPT2StateDictAdapter",  # to_hf/from_hf: GPT2LMHeadModel
            config_from_hf="titan_gpt2.hf:config_from_hf",
            config_to_hf="titan_gpt2.hf:config_to_hf",
            # Token and position embeddings both live on the first stage only.
            pipeline=PipelineInfo(
                layers_attr="layers",
                first_stage_modules=("tok_embeddings", "pos_embeddings"),
                last_stage_modules=("norm", "output"),
            ),
            capabilities=Capabilities(fsdp=True, tp=True, pp=True),
            description="GPT-2 style decoder (LayerNorm, learned positions, GELU MLP); an example plugin",
        )
    )


@hookimpl
def titan_config_searchpath():
    return "pkg://titan_gpt2.conf"
