"""Subprocess side of the conformance kit (``python -m titan_plugins.testing._probe``).

    _probe import MODULE MODEL         does importing the plugin module import torch?
    _probe parallelize TARGET CONFIGS  the parallelize hook on a fake process group

Each mode prints one JSON line as its last line of stdout.
"""

from __future__ import annotations

import importlib
import importlib.abc
import json
import os
import sys
import traceback
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from titan_plugins.distributed.parallel_dims import ParallelDims

_HERE = os.path.abspath(__file__)


# ------------------------------------------------------------------ import
class _TorchTracer(importlib.abc.MetaPathFinder):
    """Records where ``torch`` is first imported from (then lets the import go on)."""

    def __init__(self) -> None:
        self.where: str | None = None

    def find_spec(self, name, path=None, target=None):  # noqa: ARG002
        if self.where is None and (name == "torch" or name.startswith("torch.")):
            frames = [
                f for f in traceback.extract_stack()[:-1]
                if not f.filename.startswith("<") and os.path.abspath(f.filename) != _HERE
                and f"{os.sep}importlib{os.sep}" not in f.filename
            ]
            shown = [f"{_short(f.filename)}:{f.lineno} `{(f.line or '').strip()}`" for f in frames[-3:]]
            self.where = " <- ".join(reversed(shown)) or "unknown location"
        return None


def _short(path: str) -> str:
    parts = os.path.abspath(path).split(os.sep)
    return os.sep.join(parts[-2:])


def probe_import(module_ref: str, model: str) -> dict[str, Any]:
    import titan_plugins  # noqa: F401  the core's light modules first
    from titan_plugins.spec import resolve

    if "torch" in sys.modules:
        return {"skip": "the core itself imported torch; cannot tell what the plugin imports"}
    tracer = _TorchTracer()
    sys.meta_path.insert(0, tracer)
    module_name, _, attr = module_ref.partition(":")

    def step(label: str) -> dict[str, Any] | None:
        if tracer.where is not None:
            return {"step": label, "torch_at": tracer.where}
        return None

    try:
        plugin: Any = importlib.import_module(module_name)
        for part in filter(None, attr.split(".")):
            plugin = getattr(plugin, part)
    except Exception as exc:
        return step(f"importing {module_ref}") or {"error": f"{type(exc).__name__}: {exc}"}
    if found := step(f"importing {module_ref}"):
        return found
    specs: list[Any] = []
    hook = getattr(plugin, "titan_register_models", None)
    if hook is not None:
        hook(register=specs.append)
    if found := step(f"{module_name}.titan_register_models"):
        return found
    searchpath = getattr(plugin, "titan_config_searchpath", None)
    if searchpath is not None:
        searchpath()
    if found := step(f"{module_name}.titan_config_searchpath"):
        return found
    for spec in specs:
        if getattr(spec, "name", None) != model:
            continue
        resolve(spec.config)
        if found := step(f"resolving the schema {spec.config!r}"):
            return found
        resolve(spec.flavors)
        if found := step(f"resolving the flavors {spec.flavors!r}"):
            return found
    return {"ok": True}


# ------------------------------------------------------------- parallelize
def _fix(kind: str) -> str:
    from titan_plugins.testing.conformance.contract import FIXES

    return FIXES[f"parallelize-{kind}"]


def _problem(kind: str, problem: str, *, fix: str | None = None) -> dict[str, Any]:
    return {"ok": False, "contract": f"parallelize-{kind}", "problem": problem, "fix": fix or _fix(kind)}


def _unresolved_key(message: str) -> str | None:
    import re

    match = re.search(r"Parallelize plan key '([^']*)' could not be resolved", message)
    return match.group(1) if match else None


def probe_parallelize(target_json: str, configs_json: str) -> dict[str, Any]:
    from titan_plugins.testing.conformance.target import Target

    target = Target.from_json(target_json)
    configs: dict[str, dict[str, int]] = json.loads(configs_json)
    out: dict[str, Any] = {}
    for kind, degrees in configs.items():
        try:
            out[kind] = _one_config(target, kind, degrees)
        except Exception as exc:  # the check itself broke: report, do not hide
            out[kind] = _problem(kind, f"the check could not run: {type(exc).__name__}: {exc}")
        finally:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
    return out


def _one_config(target: Any, kind: str, degrees: dict[str, int]) -> dict[str, Any]:
    import warnings

    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.tensor import DTensor
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from titan_plugins.config import hydra_glue
    from titan_plugins.distributed.parallel_dims import ParallelDims
    from titan_plugins.distributed.pipeline import split_model
    from titan_plugins.errors import ConfigError
    from titan_plugins.testing.conformance.contract import one_line
    from titan_plugins.testing.conformance.contract import where as at_plugin
    from titan_plugins.testing.conformance.session import Session

    session = Session.open(target)
    spec, pm = session.spec, session.pm
    world = 1
    for value in degrees.values():
        world *= value
    if degrees.get("ep", 1) > 1:
        world //= degrees["ep"]  # EP borrows ranks
    desc = " ".join(f"{k}={v}" for k, v in degrees.items())
    par = [f"parallelism.{k}={v}" for k, v in degrees.items()]
    overrides = [f"model={target.model}", *target.for_kind(kind).overrides, *par]
    try:
        cfg = hydra_glue.compose(overrides, pm)
        _, job = hydra_glue.resolve_job(cfg, pm)
        config = hydra_glue.model_config(job.model, spec)
        validate = spec.load("validate")
        if validate is not None:
            validate(config, job.parallelism)
    except ConfigError as exc:
        return _problem(kind, f"{desc} is rejected for this model: {exc}",
                        fix=f"pick overrides the model accepts under {desc} (overrides"
                        + (f" / {kind}_overrides" if kind in ("ep", "pp") else "") + ")")
    dist.init_process_group("fake", rank=0, world_size=world, store=FakeStore())
    dims = ParallelDims.from_config(job.parallelism, world)
    dims.build_meshes("cpu")
    with torch.device("meta"):
        model = spec.load("build")(config)
    if kind == "pp":
        parts = [part for r in range(degrees["pp"]) for _, part in split_model(model, spec.pipeline, r, job.parallelism)]
    else:
        parts = [model]
    info = spec.pipeline
    parallelize = spec.load("parallelize")
    for index, part in enumerate(parts):
        where = f"under {desc}"
        if kind == "pp":
            absent = [n for n in (*info.first_stage_modules, *info.last_stage_modules) if getattr(part, n, 1) is None]
            where += f", stage {index} of {len(parts)} (where {', '.join(absent)} {'is' if len(absent) == 1 else 'are'} None)"
        non_persistent = [n for n, _ in part.named_buffers() if n not in part.state_dict()]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                result = parallelize(part, dims, job)
            except Exception as exc:
                return _problem(kind, f"the parallelize hook raised {where}: {one_line(exc)}{at_plugin(exc)}")
        for w in caught:
            key = _unresolved_key(str(w.message))
            if key is not None:
                return _problem(kind, f"the TP plan names {key!r}, which matches no module {where}")
        if result is not None and not isinstance(result, nn.Module):
            return _problem(kind, f"the parallelize hook returned {type(result).__name__} {where}",
                            fix="return the model (or None after changing it in place)")
        part = result if isinstance(result, nn.Module) else part
        for name, buf in part.named_buffers():
            if name in non_persistent and isinstance(buf, DTensor):
                return _problem("tp" if kind != "pp" else kind,
                                f"buffer {name!r} became a DTensor {where}",
                                fix="keep rotary caches plain tensors: replicate them per call "
                                "(gather_input(..., Replicate()) or replicate_like in forward), "
                                "never distribute the buffer itself")
        sharded = _check_sharded(kind, part, dims, where)
        if sharded is not None:
            return sharded
        try:
            part.to_empty(device="cpu")
            torch.manual_seed(0)
            with torch.no_grad():
                part.init_weights(buffer_device=torch.device("cpu"))
        except Exception as exc:
            return _problem(kind, f"to_empty + init_weights after parallelize raised {where}: "
                            f"{one_line(exc)}{at_plugin(exc)}",
                            fix="init_weights must work on sharded (DTensor) parameters: use nn.init "
                            "functions or in-place ops, never replace a parameter or read its full shape "
                            "from .data")
    return {"ok": True}


def _check_sharded(kind: str, part: Any, dims: ParallelDims, where: str) -> dict[str, Any] | None:
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    def on_mesh(name: str) -> bool:
        for p in part.parameters():
            if isinstance(p, DTensor) and name in (p.device_mesh.mesh_dim_names or ()):
                return True
        return False

    if kind in ("fsdp", "pp") and dims.fsdp_enabled and not isinstance(part, FSDPModule):
        return _problem(kind, f"the model is not an FSDP module {where}",
                        fix=_fix("fsdp"))
    if kind in ("tp", "pp") and dims.tp_enabled and not on_mesh("tp"):
        return _problem(kind, f"no parameter is sharded on the tp mesh {where}: the TP plan was not applied",
                        fix=_fix("tp"))
    if kind == "ep" and not on_mesh("ep"):
        return _problem(kind, f"no parameter is sharded on the ep mesh {where}",
                        fix=_fix("ep") + " (and set ep_overrides to a flavor with experts)")
    return None


def main(argv: list[str]) -> int:
    mode, *args = argv
    if mode == "import":
        result = probe_import(*args)
    elif mode == "parallelize":
        result = probe_parallelize(*args)
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    sys.stdout.write("\n" + json.dumps(result) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
