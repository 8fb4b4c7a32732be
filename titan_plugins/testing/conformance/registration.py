"""Registration contracts: the model is registered with an API range, and the plugin
module imports without torch (checked in a fresh interpreter)."""

from __future__ import annotations

import subprocess
import sys

from titan_plugins.testing.conformance.contract import CheckResult, ContractError, last_json, tail
from titan_plugins.testing.conformance.session import Session, open_session
from titan_plugins.testing.conformance.target import Target

__all__ = ["check_plugin_import", "check_registration"]


def check_registration(target: Target | Session) -> CheckResult:
    """The model is registered (by an installed or extra plugin), its declared
    capabilities agree with the spec, and the plugin declares ``TITAN_PLUGINS_API``."""
    from titan_plugins.spec import ModelSpec

    session = open_session(target)
    spec, owner = session.spec, session.owner
    if not isinstance(spec, ModelSpec):
        raise ContractError("registration", f"register() got a {type(spec).__name__}",
                            "register a titan_plugins.ModelSpec")
    if spec.capabilities.pp and spec.pipeline is None:
        raise ContractError(
            "registration", f"model {spec.name!r} declares Capabilities(pp=True) but no PipelineInfo",
            "pass pipeline=PipelineInfo(layers_attr=..., first_stage_modules=..., last_stage_modules=...) "
            "to the ModelSpec, or declare pp=False")
    if getattr(owner.plugin, "TITAN_PLUGINS_API", None) is None:
        raise ContractError(
            "registration", f"the plugin module {owner.module} declares no TITAN_PLUGINS_API",
            'add TITAN_PLUGINS_API = ">=1.0,<2" (the core API range it supports) to the plugin '
            "module; a core outside that range then reports the mismatch at load time")
    return None


def check_plugin_import(target: Target | Session, *, timeout: float = 120.0) -> CheckResult:
    """In a fresh interpreter: importing the plugin module, calling its
    ``titan_register_models`` and resolving the schema and flavors imports no torch
    (``titan-plugins list`` and Hydra's config store must stay light)."""
    session = open_session(target)
    module = session.owner.module
    proc = subprocess.run(
        [sys.executable, "-m", "titan_plugins.testing._probe", "import", module, session.target.model],
        capture_output=True, text=True, env=session.target.env(), timeout=timeout,
    )
    result = last_json(proc)
    if result is None:
        raise ContractError("plugin-import", f"importing {module} in a fresh interpreter failed: "
                            f"{tail(proc.stderr)}", "make the plugin module importable on its own")
    if result.get("skip"):
        return result["skip"]
    if result.get("error"):
        raise ContractError("plugin-import", f"importing {module} failed: {result['error']}",
                            "make the plugin module importable on its own")
    if result.get("torch_at"):
        raise ContractError(
            "plugin-import",
            f"{result['step']} imported torch ({result['torch_at']})",
            f"keep {module}, the config schema and everything they import at module level torch-free; "
            'reference heavy code by string (build="pkg.model:build") so torch loads only when the '
            "model is chosen, and import torch inside functions that need it",
        )
    return None
