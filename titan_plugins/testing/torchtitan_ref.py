"""Import TorchTitan 0.2.2 on CPU as a test-only numerics reference.

torchtitan's model packages import a triton kernel module (GPU-only, used only for
MoE index permutation on GPU) and Hugging Face ``datasets`` (data loading only) at
module level; the model definitions need neither, so both are replaced by stubs
that raise if ever called.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import sys
import types


def _stub(name: str, **attrs) -> bool:
    if name in sys.modules:
        return False
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None)
    module.__dict__.update(attrs)
    sys.modules[name] = module
    return True


def _unavailable(*_args, **_kwargs):
    raise RuntimeError("stubbed out: not available in the CPU numerics reference")


def import_torchtitan(module: str = "torchtitan.models"):
    """Import ``module`` from torchtitan; raises ImportError if torchtitan is absent.

    Tests use ``pytest.importorskip``-style skipping around this call.
    """
    try:
        import triton  # noqa: F401
    except ImportError:
        _stub(
            "torchtitan.models.moe.kernels",
            generate_permute_indices=_unavailable,
            fill_indices_wrapper=_unavailable,
        )
    stubbed: list[str] = []
    try:
        import datasets  # noqa: F401
    except ImportError:
        for name, attrs in (
            ("datasets", {"Dataset": object, "load_dataset": _unavailable}),
            ("datasets.distributed", {"split_dataset_by_node": _unavailable}),
        ):
            if _stub(name, **attrs):
                stubbed.append(name)
    try:
        return importlib.import_module(module)
    finally:
        # torchtitan has bound what it needs; the rest of the process (a test that
        # checks whether `datasets` is installed) must not see the stand-in.
        for name in stubbed:
            sys.modules.pop(name, None)
