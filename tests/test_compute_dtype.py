"""Compute dtypes: precision.param_dtype becomes the compute dtype only where no FSDP
applies it; the mixin that hands a dtype to every module reading one."""

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


def test_mixin_sets_every_module_that_reads_a_compute_dtype():
    from torch import nn

    from titan_plugins.components.compute_dtype import ComputeDtypeMixin

    class Reader(nn.Module):
        def __init__(self):
            super().__init__()
            self.compute_dtype = None

    class Model(ComputeDtypeMixin, nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.plain = Reader(), nn.Sequential(Reader()), nn.Linear(2, 2)

    model = Model()
    model.set_compute_dtype(torch.bfloat16)
    assert model.compute_dtype is torch.bfloat16
    assert model.a.compute_dtype is torch.bfloat16 and model.b[0].compute_dtype is torch.bfloat16
    assert not hasattr(model.plain, "compute_dtype")  # modules without the attribute are left alone
    assert model.plain.weight.dtype is torch.float32  # parameters keep their dtype
    model.set_compute_dtype(None)
    assert model.compute_dtype is None and model.b[0].compute_dtype is None
