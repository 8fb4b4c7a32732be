"""Config contracts: the schema is an OmegaConf-compatible dataclass, every flavor
composes through Hydra into it, and a wrongly typed or unknown override is rejected."""

from __future__ import annotations

import dataclasses
from typing import Any

from titan_plugins.testing.conformance.contract import CheckResult, ContractError, one_line
from titan_plugins.testing.conformance.session import Session, open_session
from titan_plugins.testing.conformance.target import Target

__all__ = ["check_compose", "check_schema", "check_typed_override"]


def _schema_fields(schema: type, prefix: str = "") -> list[tuple[str, Any]]:
    import typing

    hints = typing.get_type_hints(schema)
    out: list[tuple[str, Any]] = []
    for f in dataclasses.fields(schema):
        tp = hints.get(f.name, f.type)
        if dataclasses.is_dataclass(tp):
            out.extend(_schema_fields(tp, f"{prefix}{f.name}."))
        else:
            out.append((f"{prefix}{f.name}", tp))
    return out


def check_schema(target: Target | Session) -> CheckResult:
    """The schema is an OmegaConf-compatible dataclass, every flavor is an instance
    of it, and the default flavor exists."""
    from omegaconf import OmegaConf

    from titan_plugins.spec import resolve

    spec = open_session(target).spec
    fix = ("use a @dataclass with int/float/bool/str/Enum/Optional/list/nested-dataclass fields "
           "(no Literal, Callable or tuple fields: Enums and separate fields instead)")
    try:
        schema = resolve(spec.config)
    except Exception as exc:
        raise ContractError("schema", f"config={spec.config!r} does not resolve: {one_line(exc)}",
                            "point ModelSpec.config at 'package.module:ClassName'") from None
    if not (isinstance(schema, type) and dataclasses.is_dataclass(schema)):
        raise ContractError("schema", f"the config schema {schema!r} is not a dataclass class", fix)
    try:
        OmegaConf.structured(schema)
    except Exception as exc:
        raise ContractError("schema", f"{schema.__name__} is not OmegaConf-compatible: {one_line(exc)}", fix) from None
    try:
        flavors = resolve(spec.flavors)
    except Exception as exc:
        raise ContractError("schema", f"flavors={spec.flavors!r} does not resolve: {one_line(exc)}",
                            "point ModelSpec.flavors at a dict {name: ConfigInstance}") from None
    if not hasattr(flavors, "items") or not flavors:
        raise ContractError("schema", f"flavors is {type(flavors).__name__}, not a non-empty mapping",
                            "define FLAVORS = {'debugmodel': MyConfig(...), ...}")
    for name, flavor in flavors.items():
        if not isinstance(flavor, schema):
            raise ContractError(
                "schema", f"flavor {name!r} is a {type(flavor).__name__}, not a {schema.__name__}",
                f"make every flavor an instance of the schema: {schema.__name__}(...)")
        try:
            OmegaConf.structured(flavor)
        except Exception as exc:
            raise ContractError("schema", f"flavor {name!r} is not OmegaConf-compatible: {one_line(exc)}", fix) from None
    if spec.default_flavor not in flavors:
        raise ContractError(
            "schema", f"default_flavor={spec.default_flavor!r} is not a flavor (have: {', '.join(flavors)})",
            "add that flavor or set ModelSpec.default_flavor to one that exists")
    return None


def check_compose(target: Target | Session) -> CheckResult:
    """Every flavor composes through Hydra (``model=<name> model.flavor=<flavor>``
    plus the target's overrides) and resolves into the schema; the composed
    ``model`` node is typed by the schema (the YAML starts from ``/schema/model/<name>``)."""
    from omegaconf import OmegaConf

    from titan_plugins.config import hydra_glue
    from titan_plugins.spec import resolve

    session = open_session(target)
    pm, spec, target = session.pm, session.spec, session.target
    yaml = f"conf/model/{target.model}.yaml"
    start = f"`defaults: [/schema/model/{target.model}@_here_, _self_]`"
    for flavor in spec.flavor_names():
        overrides = [f"model={target.model}", f"model.flavor={flavor}", *target.overrides]
        try:
            cfg = hydra_glue.compose(overrides, pm)
            _, job = hydra_glue.resolve_job(cfg, pm)
            hydra_glue.model_config(job.model, spec)
        except Exception as exc:
            raise ContractError(
                "hydra-compose", f"{' '.join(overrides)} does not compose: {one_line(exc)}",
                f"{yaml} must start with {start} and set name: {target.model}; every flavor must "
                "hold valid values for the schema") from None
        if job.model.get("name") != target.model:
            raise ContractError(
                "hydra-compose", f"model={target.model} composes a model node named {job.model.get('name')!r}",
                f"set name: {target.model} in {yaml}")
        node_type = OmegaConf.get_type(cfg.model)
        schema = resolve(spec.config)
        if not (isinstance(node_type, type) and issubclass(node_type, schema)):
            raise ContractError(
                "hydra-compose", f"{yaml} does not start from the stored schema: the composed model node "
                f"is an untyped {getattr(node_type, '__name__', node_type)}, so Hydra cannot check "
                "model.* overrides (or sweeps) when it composes",
                f"start {yaml} with {start}")
    return None


def _bad_value_for(tp: Any) -> str | None:
    import enum
    import typing

    args = [a for a in typing.get_args(tp) if a is not type(None)]
    base = args[0] if typing.get_origin(tp) is not None and len(args) == 1 else tp
    if base is bool:
        return "not_a_bool"
    if base in (int, float):
        return "not_a_number"
    if isinstance(base, type) and issubclass(base, enum.Enum):
        return "not_a_member"
    return None


def check_typed_override(target: Target | Session) -> CheckResult:
    """A wrongly typed ``model.<key>=...`` and an unknown ``model.<key>`` are both
    rejected before any rank starts (composition and resolution) with a one-line
    ``ConfigError`` naming the key: the schema types every field."""
    from titan_plugins.config import hydra_glue
    from titan_plugins.errors import ConfigError
    from titan_plugins.spec import resolve

    session = open_session(target)
    target = session.target
    schema = resolve(session.spec.config)
    fix = (f"give the schema typed fields (int, float, bool, Enum; not Any) and start "
           f"conf/model/{target.model}.yaml with `defaults: [/schema/model/{target.model}@_here_, _self_]`")
    candidates = [(key, bad) for key, tp in _schema_fields(schema) if (bad := _bad_value_for(tp))]
    probes = [(f"model.{key}", bad) for key, bad in candidates[:1]]
    probes.append(("model.no_such_key_for_conformance", "1"))
    for key, bad in probes:
        override = f"{key}={bad}"
        try:
            cfg = hydra_glue.compose([f"model={target.model}", *target.overrides, override], session.pm)
            _, job = hydra_glue.resolve_job(cfg, session.pm)
            hydra_glue.model_config(job.model, session.spec)
        except ConfigError as exc:
            leaf = key.rsplit(".", 1)[-1]
            if leaf not in str(exc):
                raise ContractError(
                    "typed-override", f"{override} was rejected, but the error does not name the key: {exc}",
                    fix) from None
            continue
        except Exception as exc:
            raise ContractError("typed-override", f"{override} failed with {one_line(exc)} instead of a "
                                "ConfigError naming the key", fix) from None
        raise ContractError("typed-override", f"{override} was accepted: the schema does not type it", fix)
    return None
