"""The conformance checks: what a model plugin must satisfy to be a good citizen.

Every check is a plain function of a ``Target`` (a model name, the overrides to
test it with and, optionally, plugin modules to register without installing them)
usable outside pytest too::

    from titan_plugins.testing.conformance import Target, check_meta_build
    check_meta_build(Target("mymodel", overrides=("model.n_layers=2",)))

A check returns ``None`` when the contract holds, a string (the reason) when it
does not apply to this model (e.g. TP is not declared), and raises
``ContractError("<contract>: <what is wrong>. Fix: <how>")`` when it is broken.

Checks that need a process group (fake or gloo) or must see a fresh interpreter
(``plugin-import``) run in subprocesses, so they leave nothing behind in the
caller's process. This module itself imports no torch.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "CONTRACTS",
    "ContractError",
    "PARALLELISMS",
    "Target",
    "check_compose",
    "check_forward_backward",
    "check_init_weights",
    "check_loss_parity",
    "check_meta_build",
    "check_parallelize",
    "check_pipeline_split",
    "check_plugin_import",
    "check_registration",
    "check_schema",
    "check_state_dict",
    "check_typed_override",
    "run_parallelize_checks",
]

# Contract name -> what it asks of a plugin (docs/writing-a-plugin.md explains each).
CONTRACTS = {
    "registration": "the model is registered through the 'titan_plugins' entry point, with a TITAN_PLUGINS_API range",
    "plugin-import": "the plugin module, its schema and flavors import without torch",
    "schema": "the config schema is an OmegaConf-compatible dataclass and every flavor is an instance of it",
    "hydra-compose": "every flavor composes through Hydra as model=<name> model.flavor=<flavor>",
    "typed-override": "a wrongly typed or unknown model.* override is rejected, naming the key",
    "meta-build": "build(config) works under torch.device('meta') and the model has init_weights(buffer_device)",
    "init-weights": "init_weights initialises every parameter and buffer, deterministically for a seed",
    "forward-backward": "forward(tokens) returns [B, S, V] logits; backward gives finite gradients to every parameter",
    "state-dict": "state_dict() holds learned state only: derived buffers (rotary caches) are non-persistent",
    "parallelize-fsdp": "the parallelize hook shards the model with FSDP2 (apply_fsdp)",
    "parallelize-tp": "the parallelize hook applies a TP plan that resolves, leaving buffers plain tensors",
    "parallelize-ep": "the parallelize hook shards the experts over the ep mesh",
    "parallelize-pp": "the parallelize hook runs per pipeline stage, where stage-local modules are None",
    "pipeline-split": "split by PipelineInfo, each stage initialises and runs, and the stages chained give the model's logits",
    "loss-parity": "a 2-rank gloo run matches the single-rank loss within LOSS_PARITY",
    "hf-round-trip": "the adapter's from_hf(to_hf(state_dict())) is the state dict exactly, and config.json maps both ways",
}

# The degrees each fake-process-group check uses (world size = their product).
PARALLELISMS: dict[str, dict[str, int]] = {
    "fsdp": {"dp_shard": 2},
    "tp": {"tp": 2},
    "ep": {"dp_shard": 2, "ep": 2},
    "pp": {"pp": 2},  # plus tp=2 and dp_shard=2 when the model declares them
}

_FIXES = {
    "parallelize-fsdp": "call titan_plugins.distributed.fsdp.apply_fsdp(model, parallel_dims, job_config) "
    "last in the hook; it wraps each block, skips None modules and is a no-op without data parallelism",
    "parallelize-tp": "build the plan with titan_plugins.distributed.tensor_parallel (apply_tp_plan, "
    "root_plan, colwise, rowwise, norm_style, gather_input, LocalAttention); keys must name modules "
    "that exist, and buffers stay plain tensors (replicate them per call with gather_input/replicate_like)",
    "parallelize-ep": "shard the experts with titan_plugins.distributed.expert_parallel on "
    "parallel_dims.mesh('ep') and pass experts_attr= to apply_fsdp",
    "parallelize-pp": "the hook runs once per pipeline stage and modules the stage does not own "
    "(PipelineInfo.first_stage_modules / last_stage_modules) are None there: use apply_tp_plan, "
    "owned_blocks and apply_fsdp (which skip them) and guard direct access with `if model.x is not None`",
}


class ContractError(AssertionError):
    """A contract a plugin breaks: ``"<contract>: <what is wrong>. Fix: <how>"``."""

    def __init__(self, contract: str, problem: str, fix: str):
        self.contract, self.problem, self.fix = contract, problem.rstrip("."), fix.rstrip(".")
        super().__init__(f"{contract}: {self.problem}. Fix: {self.fix}.")


@dataclass(frozen=True)
class Target:
    """What the kit checks: model ``model`` with ``overrides`` (Hydra, e.g.
    ``"model.n_layers=2"``). ``plugins`` names plugin modules registered without an
    installed distribution (like ``TITAN_PLUGINS_EXTRA``); they must be importable.
    ``ep_overrides`` are added for the EP check (e.g. a flavor with experts) and
    ``pp_overrides`` for the pipeline checks (e.g. untied embeddings)."""

    model: str
    overrides: tuple[str, ...] = ()
    plugins: tuple[str, ...] = ()
    ep_overrides: tuple[str, ...] = ()
    pp_overrides: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for name in ("overrides", "plugins", "ep_overrides", "pp_overrides"):
            object.__setattr__(self, name, tuple(getattr(self, name)))

    def for_kind(self, kind: str) -> Target:
        """This target with the overrides of one parallelism (``ep``, ``pp``) added."""
        extra = {"ep": self.ep_overrides, "pp": self.pp_overrides}.get(kind, ())
        if not extra:
            return self
        return dataclasses.replace(self, overrides=self.overrides + extra, ep_overrides=(), pp_overrides=())

    def env(self) -> dict[str, str]:
        """The environment for subprocesses: this interpreter's import path and the
        extra plugin modules."""
        env = dict(os.environ)
        paths = [p for p in sys.path if p and os.path.isdir(p)]
        paths += [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
        if self.plugins:
            current = [m for m in env.get("TITAN_PLUGINS_EXTRA", "").split(",") if m]
            env["TITAN_PLUGINS_EXTRA"] = ",".join(dict.fromkeys([*current, *self.plugins]))
        env.setdefault("OMP_NUM_THREADS", "1")
        return env

    def as_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Target:
        return cls(**json.loads(text))


# ------------------------------------------------------------------ loading
@dataclass
class _Loaded:
    pm: Any
    spec: Any
    owner: Any
    job: Any = None
    config: Any = None
    cache: dict = field(default_factory=dict)


_LOADED: dict[Target, _Loaded] = {}


def _load(target: Target) -> _Loaded:
    """The plugin manager and spec for ``target`` (cached per target)."""
    if target in _LOADED:
        return _LOADED[target]
    from titan_plugins.errors import TitanError
    from titan_plugins.plugins import get_plugin_manager

    pm = get_plugin_manager()
    missing = [m for m in target.plugins if m not in pm.infos]
    if missing:
        pm.load_modules(missing)
    try:
        spec = pm.get_model(target.model)
        owner = pm.model_owner(target.model)
    except TitanError as exc:
        errors = "; ".join(pm.errors)
        raise ContractError(
            "registration",
            f"{exc}" + (f" (plugin load errors: {errors})" if errors else ""),
            "install your distribution (pip install -e .) so its 'titan_plugins' entry point is "
            "visible, and register a ModelSpec with this name in titan_register_models",
        ) from None
    loaded = _Loaded(pm=pm, spec=spec, owner=owner)
    _LOADED[target] = loaded
    return loaded


def _job(target: Target) -> _Loaded:
    """``_load`` plus the composed, resolved job and the schema instance."""
    loaded = _load(target)
    if loaded.job is None:
        from titan_plugins.config import hydra_glue

        try:
            cfg = hydra_glue.compose([f"model={target.model}", *target.overrides], loaded.pm)
            _, job = hydra_glue.resolve_job(cfg, loaded.pm)
            config = hydra_glue.model_config(job.model, loaded.spec)
        except Exception as exc:
            raise ContractError(
                "hydra-compose",
                f"model={target.model} {' '.join(target.overrides)} does not compose: {_one_line(exc)}",
                "check the overrides and conf/model/<name>.yaml (it starts from "
                "/schema/model/<name>@_here_); run `titan-run model=<name> --cfg job` to see the error",
            ) from None
        loaded.job, loaded.config = job, config
    return loaded


def _one_line(exc: BaseException) -> str:
    text = " ".join(line.strip() for line in str(exc).splitlines() if line.strip())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _where(exc: BaseException) -> str:
    """``file:line`` of the innermost frame outside torch and the core (the plugin's)."""
    import titan_plugins

    core = os.path.dirname(titan_plugins.__file__)
    frames = traceback.extract_tb(exc.__traceback__)
    for frame in reversed(frames):
        path = frame.filename
        if f"{os.sep}torch{os.sep}" in path or path.startswith(core) or path.startswith("<"):
            continue
        return f" (at {_short(path)}:{frame.lineno})"
    return ""


def _short(path: str) -> str:
    parts = path.split(os.sep)
    return os.sep.join(parts[-2:]) if len(parts) > 1 else path


# ------------------------------------------------------------ registration
def check_registration(target: Target) -> None:
    """The model is registered (by an installed or extra plugin), its declared
    capabilities agree with the spec, and the plugin declares ``TITAN_PLUGINS_API``."""
    from titan_plugins.spec import ModelSpec

    loaded = _load(target)
    spec, owner = loaded.spec, loaded.owner
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


# ----------------------------------------------------------- plugin import
def check_plugin_import(target: Target, *, timeout: float = 120.0) -> None:
    """In a fresh interpreter: importing the plugin module, calling its
    ``titan_register_models`` and resolving the schema and flavors imports no torch
    (``titan-plugins list`` and Hydra's config store must stay light)."""
    loaded = _load(target)
    module = loaded.owner.module
    proc = subprocess.run(
        [sys.executable, "-m", "titan_plugins.testing._probe", "import", module, target.model],
        capture_output=True, text=True, env=target.env(), timeout=timeout,
    )
    result = _last_json(proc)
    if result is None:
        raise ContractError("plugin-import", f"importing {module} in a fresh interpreter failed: "
                            f"{_tail(proc.stderr)}", "make the plugin module importable on its own")
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


def _last_json(proc: subprocess.CompletedProcess) -> dict | None:
    for line in reversed(proc.stdout.strip().splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                return None
    return None


def _tail(text: str, n: int = 3) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return " | ".join(lines[-n:]) or "no output"


# ------------------------------------------------------------------ config
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


def check_schema(target: Target) -> None:
    """The schema is an OmegaConf-compatible dataclass, every flavor is an instance
    of it, and the default flavor exists."""
    from omegaconf import OmegaConf

    from titan_plugins.spec import resolve

    spec = _load(target).spec
    fix = ("use a @dataclass with int/float/bool/str/Enum/Optional/list/nested-dataclass fields "
           "(no Literal, Callable or tuple fields: Enums and separate fields instead)")
    try:
        schema = resolve(spec.config)
    except Exception as exc:
        raise ContractError("schema", f"config={spec.config!r} does not resolve: {_one_line(exc)}",
                            "point ModelSpec.config at 'package.module:ClassName'") from None
    if not (isinstance(schema, type) and dataclasses.is_dataclass(schema)):
        raise ContractError("schema", f"the config schema {schema!r} is not a dataclass class", fix)
    try:
        OmegaConf.structured(schema)
    except Exception as exc:
        raise ContractError("schema", f"{schema.__name__} is not OmegaConf-compatible: {_one_line(exc)}", fix) from None
    try:
        flavors = resolve(spec.flavors)
    except Exception as exc:
        raise ContractError("schema", f"flavors={spec.flavors!r} does not resolve: {_one_line(exc)}",
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
            raise ContractError("schema", f"flavor {name!r} is not OmegaConf-compatible: {_one_line(exc)}", fix) from None
    if spec.default_flavor not in flavors:
        raise ContractError(
            "schema", f"default_flavor={spec.default_flavor!r} is not a flavor (have: {', '.join(flavors)})",
            "add that flavor or set ModelSpec.default_flavor to one that exists")
    return None


def check_compose(target: Target) -> None:
    """Every flavor composes through Hydra (``model=<name> model.flavor=<flavor>``
    plus the target's overrides) and resolves into the schema; the composed
    ``model`` node is typed by the schema (the YAML starts from ``/schema/model/<name>``)."""
    from omegaconf import OmegaConf

    from titan_plugins.config import hydra_glue
    from titan_plugins.spec import resolve

    loaded = _load(target)
    pm, spec = loaded.pm, loaded.spec
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
                "hydra-compose", f"{' '.join(overrides)} does not compose: {_one_line(exc)}",
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


def check_typed_override(target: Target) -> None:
    """A wrongly typed ``model.<key>=...`` and an unknown ``model.<key>`` are both
    rejected before any rank starts (composition and resolution) with a one-line
    ``ConfigError`` naming the key: the schema types every field."""
    from titan_plugins.config import hydra_glue
    from titan_plugins.errors import ConfigError
    from titan_plugins.spec import resolve

    loaded = _load(target)
    schema = resolve(loaded.spec.config)
    fix = (f"give the schema typed fields (int, float, bool, Enum; not Any) and start "
           f"conf/model/{target.model}.yaml with `defaults: [/schema/model/{target.model}@_here_, _self_]`")
    candidates = [(key, bad) for key, tp in _schema_fields(schema) if (bad := _bad_value_for(tp))]
    probes = [(f"model.{key}", bad) for key, bad in candidates[:1]]
    probes.append(("model.no_such_key_for_conformance", "1"))
    for key, bad in probes:
        override = f"{key}={bad}"
        try:
            cfg = hydra_glue.compose([f"model={target.model}", *target.overrides, override], loaded.pm)
            _, job = hydra_glue.resolve_job(cfg, loaded.pm)
            hydra_glue.model_config(job.model, loaded.spec)
        except ConfigError as exc:
            leaf = key.rsplit(".", 1)[-1]
            if leaf not in str(exc):
                raise ContractError(
                    "typed-override", f"{override} was rejected, but the error does not name the key: {exc}",
                    fix) from None
            continue
        except Exception as exc:
            raise ContractError("typed-override", f"{override} failed with {_one_line(exc)} instead of a "
                                "ConfigError naming the key", fix) from None
        raise ContractError("typed-override", f"{override} was accepted: the schema does not type it", fix)
    return None


# ------------------------------------------------------------- the module
def _build_meta(target: Target):
    import torch

    loaded = _job(target)
    build = loaded.spec.load("build")
    with torch.device("meta"):
        return build(loaded.config)


def check_meta_build(target: Target) -> None:
    """``build(config)`` works under ``torch.device("meta")``: every parameter and
    buffer is on meta, and the model has ``init_weights(buffer_device=None)``."""
    import inspect

    import torch
    from torch import nn

    fix_meta = ("the core builds on meta and materializes with to_empty: create tensors without an "
                "explicit device (nn.Parameter(torch.empty(...)), register_buffer) and never call "
                ".to(device), numpy or data-dependent code in __init__")
    try:
        model = _build_meta(target)
    except ContractError:
        raise
    except Exception as exc:
        raise ContractError("meta-build", f"build(config) under torch.device('meta') raised "
                            f"{_one_line(exc)}{_where(exc)}", fix_meta) from None
    if not isinstance(model, nn.Module):
        raise ContractError("meta-build", f"build(config) returned {type(model).__name__}, not an nn.Module",
                            "return the model instance from build")
    for kind, named in (("parameter", model.named_parameters()), ("buffer", model.named_buffers())):
        for name, tensor in named:
            if tensor.device != torch.device("meta"):
                raise ContractError("meta-build", f"{kind} {name!r} was created on {tensor.device} "
                                    "under torch.device('meta')", fix_meta)
    init = getattr(model, "init_weights", None)
    if not callable(init):
        raise ContractError("meta-build", f"{type(model).__name__} has no init_weights method",
                            "define init_weights(self, buffer_device=None) that initialises every "
                            "parameter and rebuilds non-persistent buffers on buffer_device")
    try:
        inspect.signature(init).bind(buffer_device=None)
    except TypeError:
        raise ContractError("meta-build", "init_weights does not accept buffer_device=",
                            "define init_weights(self, buffer_device=None)") from None
    return None


def _materialize(target: Target, seed: int, *, poison: bool = False):
    """The model as the core makes it: meta build -> to_empty -> seeded init_weights.
    ``poison`` fills every floating tensor with NaN before init_weights."""
    import torch

    model = _build_meta(target)
    model.to_empty(device="cpu")
    if poison:
        with torch.no_grad():
            for tensor in [*model.parameters(), *model.buffers()]:
                if tensor.is_floating_point() or tensor.is_complex():
                    tensor.fill_(float("nan"))
    torch.manual_seed(seed)
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device("cpu"))
    return model


def _all_tensors(model) -> dict[str, Any]:
    out = dict(model.named_parameters())
    out.update(dict(model.named_buffers()))
    return out


def check_init_weights(target: Target) -> None:
    """``init_weights`` sets every parameter and floating buffer (nothing is left as
    ``to_empty`` left it), gives bitwise equal weights for one seed, and uses the
    seed (another seed gives other weights)."""
    import torch

    check_meta_build(target)
    where = "init_weights(buffer_device) after to_empty"
    try:
        first = _materialize(target, 0, poison=True)
    except Exception as exc:
        raise ContractError("init-weights", f"{where} raised {_one_line(exc)}{_where(exc)}",
                            "make init_weights work on a materialized (to_empty) model") from None
    params = dict(first.named_parameters())
    for name, tensor in _all_tensors(first).items():
        if (tensor.is_floating_point() or tensor.is_complex()) and torch.isnan(tensor).any():
            if name in params:
                raise ContractError(
                    "init-weights", f"parameter {name!r} is not initialised by init_weights (it keeps what "
                    "to_empty left)", "initialise every parameter in init_weights: the model is built on "
                    "meta, so what __init__ did is lost")
            raise ContractError(
                "init-weights", f"buffer {name!r} is not set by init_weights (it keeps what to_empty left)",
                "rebuild buffers in init_weights(buffer_device), e.g. self.freqs_cis = "
                "precompute(..., device=buffer_device)")
    second = _materialize(target, 0, poison=True)
    a, b = _all_tensors(first), _all_tensors(second)
    for name, tensor in a.items():
        if not torch.equal(tensor, b[name]):
            raise ContractError(
                "init-weights", f"two initialisations with seed 0 differ in {name!r}",
                "draw all randomness from torch's global generator (the core calls torch.manual_seed "
                "before init_weights); no unseeded torch.Generator, time or os based seeds")
    other_model = _materialize(target, 1)
    other = _all_tensors(other_model)
    if params and all(torch.equal(a[name], other[name]) for name in params):
        raise ContractError("init-weights", "seeds 0 and 1 give identical parameters",
                            "initialise parameters randomly from torch's global generator (nn.init.*)")
    _load(target).cache["init"] = (first, other_model)
    return None


_DERIVED_NAMES = {"freqs_cis", "rope_cache", "rope", "inv_freq", "cos_cached", "sin_cached",
                  "cos_cache", "sin_cache", "cos", "sin", "causal_mask", "attn_mask", "mask",
                  "position_ids"}


def check_state_dict(target: Target, *, persistent_buffers: Sequence[str] = ()) -> None:
    """``state_dict()`` holds learned state only. A persistent buffer fails when it is
    a rotary/mask cache by name, complex, or rebuilt by ``init_weights`` to the same
    non-constant value for every seed (i.e. derived from the config). Buffers that
    are real state (MoE expert biases, counters) pass; ``persistent_buffers`` lists
    names (full or last component) to accept anyway."""
    import torch

    loaded = _load(target)
    if "init" not in loaded.cache:
        check_init_weights(target)
    model, other = loaded.cache["init"]
    keys = set(model.state_dict().keys())
    other_buffers = dict(other.named_buffers())
    allowed = set(persistent_buffers)
    for name, buf in model.named_buffers():
        if name not in keys or name in allowed or name.rsplit(".", 1)[-1] in allowed:
            continue
        leaf = name.rsplit(".", 1)[-1]
        if leaf in _DERIVED_NAMES:
            why = "a cache derived from the config"
        elif buf.is_complex():
            why = "a complex cache derived from the config"
        elif buf.numel() > 1 and buf.is_floating_point() and torch.equal(buf, other_buffers[name]) \
                and not torch.all(buf == buf.flatten()[0]):
            why = "rebuilt by init_weights to the same values for every seed (derived from the config)"
        else:
            continue
        raise ContractError(
            "state-dict", f"buffer {name!r} is saved in state_dict(), but it is {why}",
            f"register it with self.register_buffer({leaf!r}, ..., persistent=False) and rebuild it in "
            "init_weights(buffer_device); checkpoints hold learned state only (list it in "
            "persistent_buffers if it really is state)")
    return None


def _vocab_size(model, config) -> int:
    vocab = getattr(config, "vocab_size", None)
    if vocab is None:
        emb = getattr(model, "tok_embeddings", None)
        vocab = getattr(emb, "num_embeddings", None)
    if vocab is None:
        raise ContractError("forward-backward", "cannot tell the vocabulary size",
                            "give the schema a vocab_size field or the model a tok_embeddings embedding")
    return int(vocab)


def _seq_len(loaded: _Loaded, limit: int = 16) -> int:
    seq = min(int(loaded.job.training.seq_len), limit)
    max_seq = getattr(loaded.config, "max_seq_len", None)
    return min(seq, int(max_seq)) if max_seq else seq


def check_forward_backward(target: Target, *, batch: int = 2) -> None:
    """On one rank: ``forward(tokens)`` of ``[B, S]`` ids returns plain ``[B, S, V]``
    logits, the cross-entropy loss is finite and ``backward`` gives every parameter a
    finite gradient."""
    import torch
    import torch.nn.functional as F

    loaded = _job(target)
    model = _materialize(target, 0)
    model.train()
    vocab = _vocab_size(model, loaded.config)
    seq = _seq_len(loaded)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, (batch, seq + 1), generator=gen)
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    try:
        logits = model(inputs)
    except Exception as exc:
        raise ContractError("forward-backward", f"forward on [{batch}, {seq}] token ids raised "
                            f"{_one_line(exc)}{_where(exc)}", "forward(tokens) takes int64 ids "
                            "[batch, seq] on the first stage") from None
    if type(logits) is not torch.Tensor:
        raise ContractError("forward-backward", f"forward returned {type(logits).__name__}",
                            "return the logits as a plain tensor")
    if tuple(logits.shape) != (batch, seq, vocab):
        raise ContractError("forward-backward", f"forward returned shape {tuple(logits.shape)}, "
                            f"expected [batch, seq, vocab] = {[batch, seq, vocab]}",
                            "return logits [B, S, V] from the last stage")
    loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
    if not torch.isfinite(loss):
        raise ContractError("forward-backward", f"the loss of a freshly initialised model is {loss.item()}",
                            "check init_weights and the forward for overflow or NaN")
    try:
        loss.backward()
    except Exception as exc:
        raise ContractError("forward-backward", f"backward raised {_one_line(exc)}{_where(exc)}",
                            "keep the forward differentiable (no in-place ops on leaves, no .data)") from None
    unused = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]
    if unused:
        more = f" (+{len(unused) - 3} more)" if len(unused) > 3 else ""
        raise ContractError("forward-backward", f"parameters get no gradient: {', '.join(unused[:3])}{more}",
                            "every parameter must take part in forward (FSDP and DDP need it); "
                            "hold constants as buffers instead")
    for name, p in model.named_parameters():
        if p.grad is not None and not torch.isfinite(p.grad).all():
            raise ContractError("forward-backward", f"the gradient of {name!r} is not finite",
                                "check the forward for overflow or NaN")
    return None


# ------------------------------------------------------------- pipeline
def check_pipeline_split(target: Target) -> None:
    """With ``PipelineInfo``: blocks live in an ``nn.ModuleDict`` keyed "0".."n-1";
    split into 2 stages by the core, modules a stage does not own are None, each
    stage initialises and runs (later stages take hidden states), parameter names
    are kept, and the stages chained reproduce the whole model's logits."""
    import types

    import torch
    from torch import nn

    from titan_plugins.distributed.pipeline import split_model, stage_inputs

    target = target.for_kind("pp")
    loaded = _job(target)
    info = loaded.spec.pipeline
    if info is None:
        return f"model {target.model!r} registers no PipelineInfo (no pipeline parallelism)"
    meta = _build_meta(target)
    layers = getattr(meta, info.layers_attr, None)
    if not isinstance(layers, nn.ModuleDict):
        raise ContractError(
            "pipeline-split", f"model.{info.layers_attr} is {type(layers).__name__}, not an nn.ModuleDict",
            f"keep the blocks in self.{info.layers_attr} = nn.ModuleDict({{str(i): Block(...) for i in "
            "range(n_layers)}}) so a stage can delete the ones it does not own (and names stay stable)")
    keys = list(layers.keys())
    if keys != [str(i) for i in range(len(keys))]:
        raise ContractError("pipeline-split", f"model.{info.layers_attr} is keyed {keys[:4]}..., not '0'..'n-1'",
                            "key the blocks by their index as strings")
    for name in (*info.first_stage_modules, *info.last_stage_modules):
        if getattr(meta, name, None) is None:
            raise ContractError("pipeline-split", f"PipelineInfo names {name!r}, which the model does not have",
                                "list in first_stage_modules/last_stage_modules the attribute names of "
                                "the modules only the first/last stage owns")
    if len(keys) < 2:
        return f"model has {len(keys)} layer(s): a pipeline split needs at least 2 (override model.n_layers)"
    full = _materialize(target, 0)
    full_sd = full.state_dict()
    vocab = _vocab_size(full, loaded.config)
    seq = _seq_len(loaded)
    tokens = torch.randint(0, vocab, (2, seq), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = full(tokens)
    parallelism = types.SimpleNamespace(pp=2, pp_stages_per_rank=1)
    stages = [part for r in range(2) for _, part in split_model(meta, info, r, parallelism)]
    for index, stage in enumerate(stages):
        absent = info.last_stage_modules if index == 0 else info.first_stage_modules
        for name in absent:
            if getattr(stage, name, "missing") is not None:
                raise ContractError("pipeline-split", f"stage {index} still has {name!r} after the split",
                                    "do not re-create modules outside __init__")
        what = f"stage {index} of 2 (where {', '.join(absent)} {'is' if len(absent) == 1 else 'are'} None)"
        stage.to_empty(device="cpu")
        try:
            with torch.no_grad():
                stage.init_weights(buffer_device=torch.device("cpu"))
        except Exception as exc:
            raise ContractError("pipeline-split", f"init_weights fails on {what}: {_one_line(exc)}{_where(exc)}",
                                "skip modules that are None in init_weights (`if self.norm is not None:`)") from None
        stage_sd = stage.state_dict()
        foreign = [k for k in stage_sd if k not in full_sd]
        if foreign:
            raise ContractError("pipeline-split", f"{what} has parameters the whole model lacks: {foreign[:3]}",
                                "keep parameter names (FQNs) identical on every stage")
        stage.load_state_dict({k: full_sd[k] for k in stage_sd}, strict=True)
    if info.stage_inputs and not callable(getattr(stages[-1], info.stage_inputs, None)):
        raise ContractError("pipeline-split", f"PipelineInfo.stage_inputs={info.stage_inputs!r} is not a "
                            "method of the model", "define it as (tokens) -> dict[str, Tensor] on the model class")
    extra = stage_inputs(stages[-1], info, tokens)  # what the trainer hands every stage
    h = tokens
    for index, stage in enumerate(stages):
        absent = info.last_stage_modules if index == 0 else info.first_stage_modules
        try:
            with torch.no_grad():
                h = stage(h, **extra)
        except Exception as exc:
            raise ContractError(
                "pipeline-split", f"forward fails on stage {index} of 2 (where {', '.join(absent)} is None; "
                f"input {'token ids' if index == 0 else 'hidden states'}): {_one_line(exc)}{_where(exc)}",
                "in forward, h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens, "
                "and likewise skip norm/output when they are None") from None
        if type(h) is not torch.Tensor:
            raise ContractError("pipeline-split", f"stage {index} returned {type(h).__name__}",
                                "stages exchange plain tensors")
    if h.shape != expected.shape or not torch.allclose(h, expected, rtol=1e-5, atol=1e-5):
        diff = (h - expected).abs().max().item() if h.shape == expected.shape else "shape " + str(tuple(h.shape))
        raise ContractError("pipeline-split", f"the two stages chained do not give the whole model's logits "
                            f"(max difference {diff})", "a stage's forward must do exactly the whole model's "
                            "computation for the blocks it owns; keep global state (positions, caches) "
                            "independent of which blocks are present")
    return None


# ------------------------------------------------- parallelize (fake group)
def parallelize_configs(target: Target) -> dict[str, dict[str, int] | str]:
    """Which fake-process-group configurations apply: ``kind -> degrees`` or a skip reason."""
    caps = _load(target).spec.capabilities
    out: dict[str, dict[str, int] | str] = {}
    for kind in ("fsdp", "tp", "ep", "pp"):
        if not getattr(caps, kind):
            out[kind] = f"model {target.model!r} does not declare {kind} (Capabilities({kind}=False))"
            continue
        degrees = dict(PARALLELISMS[kind])
        if kind == "pp":
            if caps.tp:
                degrees["tp"] = 2
            if caps.fsdp:
                degrees["dp_shard"] = 2
        out[kind] = degrees
    return out


def run_parallelize_checks(target: Target, *, timeout: float = 300.0) -> dict[str, ContractError | str | None]:
    """Every applicable parallelize check in one subprocess on a fake process group:
    ``kind -> None`` (holds), a skip reason, or the ``ContractError``. Cached."""
    loaded = _load(target)
    if "parallelize" in loaded.cache:
        return loaded.cache["parallelize"]
    configs = parallelize_configs(target)
    run = {k: v for k, v in configs.items() if isinstance(v, dict)}
    results: dict[str, ContractError | str | None] = {k: v for k, v in configs.items() if isinstance(v, str)}
    if run:
        proc = subprocess.run(
            [sys.executable, "-m", "titan_plugins.testing._probe", "parallelize", target.as_json(),
             json.dumps(run)],
            capture_output=True, text=True, env=target.env(), timeout=timeout,
        )
        data = _last_json(proc) or {}
        for kind in run:
            item = data.get(kind)
            if item is None:
                results[kind] = ContractError(
                    f"parallelize-{kind}", f"the fake-process-group check crashed: {_tail(proc.stderr)}",
                    _FIXES[f"parallelize-{kind}"])
            elif item.get("ok"):
                results[kind] = None
            else:
                results[kind] = ContractError(item["contract"], item["problem"], item["fix"])
    loaded.cache["parallelize"] = results
    return results


def check_parallelize(target: Target, kind: str) -> None:
    """The parallelize hook under ``kind`` (``fsdp``, ``tp``, ``ep``, ``pp``) on a fake
    process group: it succeeds per stage, the plan resolves, the model is really
    sharded, buffers stay plain tensors and ``to_empty`` + ``init_weights`` work."""
    result = run_parallelize_checks(target)[kind]
    if isinstance(result, ContractError):
        raise result
    return result


# ----------------------------------------------------------- loss parity
# kind -> the 2-rank run; every run starts from one seed checkpoint (made once on
# one rank, as titan-compare does) and sees the same global batch of 4 sequences.
_PARITY_RUNS = {
    "fsdp": ("parallelism=fsdp2", "training.local_batch_size=2"),
    "tp": ("parallelism=tp2", "training.local_batch_size=4"),
}
_PARITY_BASE = ("parallelism=single", "training.local_batch_size=4")
TRAIN_OVERRIDES = ("training.steps=3", "training.seq_len=32", "training.warmup_steps=1",
                   "training.deterministic=true", "metrics.tensorboard=false", "metrics.console=false")


def check_loss_parity(
    target: Target, kind: str = "fsdp", *, run_dir: str | os.PathLike | None = None,
    train_overrides: Sequence[str] = TRAIN_OVERRIDES, timeout: float = 300.0,
) -> None:
    """A short gloo run at 2 ranks (``fsdp``: dp_shard=2, ``tp``: tp=2) gives the
    single-rank loss at every step within ``LOSS_PARITY``: both start from one seed
    checkpoint and see the same global batch."""
    import tempfile

    from titan_plugins.compare.tolerances import LOSS_PARITY

    loaded = _load(target)
    if not getattr(loaded.spec.capabilities, kind):
        return f"model {target.model!r} does not declare {kind}"
    base_dir = str(run_dir or loaded.cache.setdefault("tmp", tempfile.mkdtemp(prefix="titan-kit-")))
    common = [f"model={target.model}", *target.overrides, *train_overrides]
    key = ("parity-base", tuple(train_overrides))
    if key not in loaded.cache:
        seed_dir = os.path.join(base_dir, "seed")
        _train(target, [*common, "parallelism=single", "checkpoint.create_seed=true"], seed_dir, timeout,
               losses=False)
        seed = os.path.join(seed_dir, "checkpoints", "seed")
        base = _train(target, [*common, *_PARITY_BASE, f"checkpoint.init_from={seed}"],
                      os.path.join(base_dir, "single"), timeout)
        loaded.cache[key] = (seed, base)
    seed, base = loaded.cache[key]
    test = _train(target, [*common, *_PARITY_RUNS[kind], f"checkpoint.init_from={seed}"],
                  os.path.join(base_dir, kind), timeout)
    tol = LOSS_PARITY
    for step, (b, t) in enumerate(zip(base.losses, test.losses), start=1):
        if not (math.isfinite(t) and tol.allows(b, t)):
            raise ContractError(
                "loss-parity",
                f"step {step}: loss {t:.7f} under {kind} (2 ranks) vs {b:.7f} on one rank, same seed "
                f"checkpoint and global batch (tolerance rtol={tol.rtol:g}, atol={tol.atol:g})",
                "a parallelism must not change the math: check the TP plan's layouts (row-wise outputs, "
                "norms under sequence parallel, replicated modules wrapped), that nothing depends on the "
                "local batch or sequence size, and compare the runs with `titan-compare`")
    if len(test.losses) != len(base.losses):
        raise ContractError("loss-parity", f"the {kind} run logged {len(test.losses)} steps, one rank "
                            f"{len(base.losses)}", "make every rank finish every step")
    return None


def _train(target: Target, overrides: list[str], run_dir: str, timeout: float, *, losses: bool = True):
    from titan_plugins.train.api import run

    os.makedirs(run_dir, exist_ok=True)
    env = {k: v for k, v in target.env().items() if k in ("PYTHONPATH", "TITAN_PLUGINS_EXTRA", "OMP_NUM_THREADS")}
    try:
        result = run(overrides, run_dir=run_dir, extra_plugins=target.plugins, timeout=timeout, env=env)
    except Exception as exc:
        raise ContractError("loss-parity", f"{' '.join(overrides)} is rejected: {_one_line(exc)}",
                            "make the model train under titan-run with these overrides") from None
    if result.returncode != 0 or (losses and not result.losses):
        raise ContractError("loss-parity", f"titan-run {' '.join(overrides)} failed: {result.error}",
                            f"run it yourself (run dir {run_dir}) to see the whole error")
    return result
