"""titan-plugins entry point for any Hugging Face causal LM. Light: imports no torch
and no transformers (both load only when ``model=hf`` is chosen)."""

from titan_plugins import Capabilities, ModelSpec, PipelineInfo, hookimpl

TITAN_PLUGINS_API = ">=1.0,<2"


@hookimpl
def titan_register_models(register):
    register(
        ModelSpec(
            name="hf",
            config="titan_hf.config:HFModelConfig",
            flavors="titan_hf.config:FLAVORS",
            default_flavor="folder",
            build="titan_hf.model:build",
            parallelize="titan_hf.parallelize:parallelize",
            validate="titan_hf.validate:validate",
            check_decoding="titan_hf.validate:check_decoding",
            state_dict_adapter="titan_hf.state_dict_adapter:HFStateDictAdapter",
            flops="titan_hf.model:flops",
            config_from_hf="titan_hf.config:config_from_hf",
            config_to_hf="titan_hf.config:config_to_hf",
            verify="titan_hf.verify:verify",
            pipeline=PipelineInfo(
                layers_attr="layers",
                first_stage_modules=("tok_embeddings",),
                last_stage_modules=("norm", "output"),
            ),
            # What the hook implements; validate() refuses in one line what a folder's
            # structure cannot take (no TP plan, no EP plan or no experts, tied + PP,
            # CP on an architecture without SDPA).
            capabilities=Capabilities(fsdp=True, tp=True, ep=True, pp=True, cp=True),
            description="any decoder-only causal LM of the installed transformers 5.x (docs/hf-matrix.md)",
            # transformers' shared modules (~4 s of CPU): imported once by the fork server
            rank_imports=("transformers", "transformers.modeling_utils", "transformers.modeling_layers",
                          "transformers.masking_utils", "transformers.core_model_loading",
                          "transformers.conversion_mapping"),
        )
    )


@hookimpl
def titan_config_searchpath():
    return "pkg://titan_hf.conf"
