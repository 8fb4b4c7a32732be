"""Composition: the job config from Hydra's compose API, then the resolved job
(the chosen flavor, config.json of ``model.hf`` and the overrides merged).

Hydra runs only in the outer process; ranks read the resolved file with OmegaConf
and rebuild the model's dataclass with :func:`model_config`.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from titan_plugins.config.hydra_errors import config_error, model_error
from titan_plugins.config.options import CONFIG_MODULE, PRIMARY_CONFIG
from titan_plugins.config.store import MODEL_META_KEYS, register_configs
from titan_plugins.errors import ConfigError
from titan_plugins.plugins import TitanPluginManager
from titan_plugins.spec import ModelSpec, resolve

_PLAN_SWITCH = re.compile(r"^plan=(true|false|True|False)$")
_PLAN_WORLD = "plan.world_size="


def normalize_overrides(overrides: Sequence[str]) -> list[str]:
    """``plan=true`` is shorthand for ``plan.enabled=true`` (``plan`` is a node beside
    ``plan.ranks`` and the rest). ``plan.world_size=N`` is another spelling of
    ``parallelism.world_size=N``: the world size is one key, for a plan as for a run."""
    out = []
    for o in overrides:
        if m := _PLAN_SWITCH.match(o):
            o = f"plan.enabled={m.group(1).lower()}"
        elif o.startswith(_PLAN_WORLD):
            o = "parallelism.world_size=" + o[len(_PLAN_WORLD):]
        out.append(o)
    return out


def compose(overrides: Sequence[str], pm: TitanPluginManager, *, return_hydra_config: bool = False) -> DictConfig:
    """Compose the job config with Hydra's compose API (no output dir, no run)."""
    overrides = normalize_overrides(overrides)
    from hydra import compose as hydra_compose
    from hydra import initialize_config_module
    from hydra.core.global_hydra import GlobalHydra

    register_configs(pm)
    GlobalHydra.instance().clear()
    try:
        with initialize_config_module(config_module=CONFIG_MODULE, version_base="1.3"):
            return hydra_compose(
                config_name=PRIMARY_CONFIG,
                overrides=list(overrides),
                return_hydra_config=return_hydra_config,
            )
    except ConfigError:
        raise
    except Exception as exc:  # Hydra's and OmegaConf's errors, rewritten as one line
        raise config_error(exc, overrides, pm) from exc
    finally:
        GlobalHydra.instance().clear()


def _without_missing(tree: Any) -> Any:
    """Drop ``???`` leaves: what the flavor provides stays the flavor's."""
    if isinstance(tree, dict):
        return {k: _without_missing(v) for k, v in tree.items() if v != "???"}
    return tree


def resolve_model(model_node: DictConfig, spec: ModelSpec) -> DictConfig:
    """Merge the chosen flavor with the user's overrides; returns a typed node
    with every field set (name and flavor included)."""
    flavor_name = model_node.get("flavor") or spec.default_flavor
    flavor = spec.flavor(flavor_name)
    schema = resolve(spec.config)
    base = OmegaConf.structured(schema)
    user = _without_missing(
        {k: v for k, v in OmegaConf.to_container(model_node, resolve=True, throw_on_missing=False).items()
         if k not in MODEL_META_KEYS}
    )
    hf = model_node.get("hf")
    partial = bool(model_node.get("hf_partial", False))
    try:
        base = OmegaConf.merge(base, OmegaConf.structured(flavor))
        if hf:  # config.json on top of the flavor, the user's overrides on top of it
            from titan_plugins.hf.config import check_partial, hf_model_values, yaml_defaults

            values = hf_model_values(spec, hf)
            user = yaml_defaults(model_node, user, values)  # a YAML's ${...} yields to config.json
            check_partial(hf, values, user, partial)
            base = OmegaConf.merge(base, values)
        merged = OmegaConf.merge(base, user)
    except ConfigError:
        raise
    except Exception as exc:  # OmegaConf's merge errors, rewritten as one line
        raise model_error(exc, spec, user) from exc
    hf = str(Path(hf).resolve()) if hf else None  # ranks may start elsewhere
    out = OmegaConf.create({"name": spec.name, "flavor": flavor_name, "hf": hf, "hf_partial": partial,
                            "verify": model_node.get("verify"), "verified": model_node.get("verified")})
    return OmegaConf.merge(
        out, OmegaConf.create(OmegaConf.to_container(merged, resolve=True, enum_to_str=True))
    )


def model_config(job_model: DictConfig | dict, spec: ModelSpec) -> Any:
    """The schema dataclass instance for a resolved ``model`` node (used on ranks)."""
    schema = resolve(spec.config)
    fields = {k: v for k, v in OmegaConf.to_container(OmegaConf.create(job_model), resolve=True).items()
              if k not in MODEL_META_KEYS}
    try:
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(schema), fields))
    except Exception as exc:  # OmegaConf's merge errors, rewritten as one line
        raise model_error(exc, spec, fields) from exc


def resolve_job(cfg: DictConfig, pm: TitanPluginManager) -> tuple[ModelSpec, DictConfig]:
    """The composed config with its model resolved: what ranks read from disk."""
    if OmegaConf.is_missing(cfg, "model"):
        known = ", ".join(sorted(pm.models())) or "none installed"
        raise ConfigError(f"model is not set: add model=<name> (installed: {known})")
    name = cfg.model.get("name") if isinstance(cfg.model, DictConfig) else None
    spec = pm.get_model(name)
    job = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False))
    job.model = resolve_model(cfg.model, spec)
    if job.model.get("hf") and not job.data.get("tokenizer"):  # the folder's tokenizer.json
        from titan_plugins.hf.config import tokenizer_path

        if tokenizer_path(job.model.hf) is not None:
            job.data.tokenizer = job.model.hf
    return spec, job
