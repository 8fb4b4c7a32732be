"""precision.param_dtype becomes the compute dtype only where no FSDP applies it."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from omegaconf import OmegaConf

from titan_plugins.components.compute_dtype import unsharded_compute_dtype

DEGREES = {"dp_shard": 1, "dp_replicate": 1, "tp": 1, "pp": 1, "ep": 1}


def precision(param: str, compute: str | None = None):
    return OmegaConf.create(
        {"weight_dtype": "float32", "param_dtype": param, "reduce_dtype": "float32", "compute_dtype": compute}
    )


def test_param_dtype_is_the_compute_dtype_only_without_sharding():
    one = SimpleNamespace(**DEGREES)
    assert unsharded_compute_dtype(precision("bfloat16"), one) is torch.bfloat16
    assert unsharded_compute_dtype(precision("float32"), one) is None
    assert unsharded_compute_dtype(precision("bfloat16", "float16"), one) is None  # explicit wins
    for name in DEGREES:
        assert unsharded_compute_dtype(precision("bfloat16"), SimpleNamespace(**{**DEGREES, name: 2})) is None
