"""A ``ModelSpec`` for a plugin laid out as a TorchTitan-style model folder.

A first-party (or third-party) plugin package holds ``config.py`` (schema class,
``FLAVORS``, ``validate``, ``flops``), ``model.py`` (``build``), ``parallelize.py``
(``parallelize``), ``state_dict_adapter.py`` and, for Hugging Face interop,
``hf_config.py`` (``config_from_hf`` / ``config_to_hf``). ``folder_spec`` writes the
references of that layout once, so a plugin module says only what is its own.

Torch-free: a plugin module imports this while ``titan-plugins list`` runs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from titan_plugins.hookspecs import hookimpl
from titan_plugins.spec import Capabilities, ModelSpec, PipelineInfo

__all__ = ["LOAD_BALANCE_HOOKS", "folder_hooks", "folder_spec"]

# The MoE components' aux-loss-free balancing (``titan_plugins.components.moe``).
LOAD_BALANCE_HOOKS = "titan_plugins.components.moe:build_load_balance_hooks"


def folder_spec(
    name: str, package: str, *, config: str, adapter: str, description: str, moe: bool,
    hf: bool = True, output: str = "output", stage_inputs: str | None = "stage_inputs",
    capabilities: Capabilities | None = None, cp: bool = False,
) -> ModelSpec:
    """The spec of model ``name`` whose code lives in the folder ``package``.

    ``config``/``adapter``: class names in ``config.py``/``state_dict_adapter.py``.
    ``moe``: the model has MoE layers (load-balancing hooks, EP capability).
    ``hf``: ``hf_config.py`` maps ``config.json`` both ways. ``output``: the output
    projection's attribute (a last-stage module under PP). ``stage_inputs``: the
    model method whose result every pipeline stage gets (None: none). Default
    capabilities: FSDP, TP and PP, plus EP when ``moe``, plus CP when ``cp`` (the
    model's attention and rotary table go through the shared components).
    """

    def ref(module: str, attr: str) -> str:
        return f"{package}.{module}:{attr}"

    return ModelSpec(
        name=name,
        config=ref("config", config),
        flavors=ref("config", "FLAVORS"),
        build=ref("model", "build"),
        parallelize=ref("parallelize", "parallelize"),
        validate=ref("config", "validate"),
        state_dict_adapter=ref("state_dict_adapter", adapter),
        flops=ref("config", "flops"),
        optimizer_hooks=LOAD_BALANCE_HOOKS if moe else None,
        config_from_hf=ref("hf_config", "config_from_hf") if hf else None,
        config_to_hf=ref("hf_config", "config_to_hf") if hf else None,
        pipeline=PipelineInfo(
            layers_attr="layers",
            first_stage_modules=("tok_embeddings",),
            last_stage_modules=("norm", output),
            stage_inputs=stage_inputs,
        ),
        capabilities=capabilities or Capabilities(fsdp=True, tp=True, ep=moe, pp=True, cp=cp),
        description=description,
    )


def folder_hooks(name: str, package: str, **spec: Any) -> tuple[Callable[..., None], Callable[[], str]]:
    """The two hookimpls of a model-folder plugin: ``titan_register_models`` registering
    ``folder_spec(name, package, **spec)`` and ``titan_config_searchpath`` returning
    ``pkg://<package>.conf``. Assign them to those names in the plugin module::

        TITAN_PLUGINS_API = ">=1.0,<2"
        titan_register_models, titan_config_searchpath = folder_hooks(
            "mymodel", "my_model", config="MyConfig", adapter="MyAdapter", moe=False,
            description="...")
    """
    model = folder_spec(name, package, **spec)

    @hookimpl
    def titan_register_models(register: Callable[[ModelSpec], None]) -> None:
        register(model)

    @hookimpl
    def titan_config_searchpath() -> str:
        return f"pkg://{package}.conf"

    return titan_register_models, titan_config_searchpath
