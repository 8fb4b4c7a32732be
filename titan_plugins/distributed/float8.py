"""Float8 training through torchao (``precision=float8_tensorwise`` / ``float8_rowwise``).

``check_float8(job)`` runs before launch and ends a job that cannot run float8 with
one line: no CUDA device, compute capability below 8.9, torchao not installed
(``pip install 'titan-plugins[float8]'``), or a setting that would bypass the float8
linears. ``convert_float8(model, job, parallel_dims)`` swaps the ``nn.Linear``
layers of the meta model for torchao's ``Float8Linear`` before the plugin's
parallelize hook (TP -> EP -> AC -> compile -> FSDP), where torchao expects it.
With the tensorwise recipe and FSDP, weights are all-gathered in float8.

Not converted: the output projection (logits stay in high precision), MoE routers,
layers whose dimensions are not multiples of 16 (a float8 GEMM requirement) and the
grouped MoE experts (plain parameters, not ``nn.Linear``). Plan mode neither checks
the device nor converts: the plan counts the model's own dtypes.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from torch import nn

from titan_plugins.errors import ConfigError

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from titan_plugins.distributed.parallel_dims import ParallelDims

__all__ = ["MIN_CAPABILITY", "check_float8", "convert_float8", "float8_recipe"]

MIN_CAPABILITY = (8, 9)  # Ada / Hopper and later have float8 tensor cores
_SKIP_NAMES = ("output", "lm_head")  # the logits projection, under its usual names


def _get(node: Any, key: str, default: Any = None) -> Any:
    """A key of a DictConfig, dict or dataclass node (absent: ``default``)."""
    value = node.get(key) if hasattr(node, "get") else getattr(node, key, None)
    return default if value is None else value


def _planning(job: DictConfig) -> bool:
    return bool(_get(_get(job, "plan", {}), "enabled", False))


def float8_recipe(job: DictConfig) -> str | None:
    """``"tensorwise"`` / ``"rowwise"`` from ``precision.float8``; None when unset."""
    value = _get(job.precision, "float8")
    return None if value is None else str(getattr(value, "value", value))


def check_float8(job: DictConfig) -> None:
    """One ``ConfigError`` line when this job's float8 setting cannot run here."""
    recipe = float8_recipe(job)
    if recipe is None:
        return
    key = f"precision.float8={recipe}"
    if recipe not in ("tensorwise", "rowwise"):
        raise ConfigError(f"{key} is not one of tensorwise, rowwise")
    compute = _get(job.precision, "compute_dtype")
    if compute is not None:
        raise ConfigError(f"{key} with precision.compute_dtype={getattr(compute, 'value', compute)}: the "
                          "compute-dtype casts bypass the float8 linears (leave compute_dtype null)")
    tp = int(_get(job.parallelism, "tp", 1))
    if tp > 1:
        raise ConfigError(f"{key} with parallelism.tp={tp}: float8 tensor-parallel plans are not wired "
                          "yet (use FSDP/EP, or a bf16 precision with TP)")
    if _planning(job):
        return  # a plan runs on any machine
    _check_device(key, job)
    try:
        import torchao.float8  # noqa: F401
    except ImportError:
        raise ConfigError(f"{key} needs torchao: pip install 'titan-plugins[float8]'") from None


def _check_device(key: str, job: DictConfig) -> None:
    import torch

    from titan_plugins.distributed.parallel_dims import default_device_and_backend

    par = job.parallelism
    device, _ = default_device_and_backend(_get(par, "device", "auto"), _get(par, "backend", "auto"))
    if device != "cuda" or not torch.cuda.is_available():
        raise ConfigError(f"{key} needs a CUDA GPU with compute capability "
                          f"{MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]}+ (this job runs on {device})")
    capability = torch.cuda.get_device_capability()
    if tuple(capability) < MIN_CAPABILITY:
        raise ConfigError(
            f"{key} needs compute capability {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]}+; "
            f"{torch.cuda.get_device_name()} has {capability[0]}.{capability[1]}")


def _keep(module: nn.Module, fqn: str) -> bool:
    parts = fqn.split(".")
    if parts[-1] in _SKIP_NAMES or "router" in parts:
        return False
    out_features, in_features = module.weight.shape
    return out_features % 16 == 0 and in_features % 16 == 0


def convert_float8(model: nn.Module, job: DictConfig, parallel_dims: ParallelDims, *, emulate: bool = False) -> nn.Module:
    """``model`` with torchao ``Float8Linear`` layers when ``precision.float8`` is set
    (in place; returned for convenience). ``emulate`` runs the float8 casts without
    float8 GEMMs (torchao's CPU path, for tests)."""
    recipe = float8_recipe(job)
    if recipe is None or _planning(job):
        return model
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    if recipe == "rowwise":  # torchao all-gathers rowwise weights in high precision only
        config = Float8LinearConfig.from_recipe_name("rowwise")
    else:
        config = Float8LinearConfig(enable_fsdp_float8_all_gather=parallel_dims.dp_shard > 1)
    if emulate:
        config = dataclasses.replace(config, emulate=True)
    return convert_to_float8_training(model, config=config, module_filter_fn=_keep)
