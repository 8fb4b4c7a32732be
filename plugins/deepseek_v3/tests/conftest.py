"""Shared fixtures of the deepseek_v3 plugin's tests (self-contained: no repo-root conftest)."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session", autouse=True)
def _one_thread():
    import torch

    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def torchtitan_ref():
    """TorchTitan 0.2.2's DeepSeek-V3 modules, or a skip naming why they are missing."""
    try:
        from titan_plugins.testing.torchtitan_ref import import_torchtitan

        model = import_torchtitan("torchtitan.models.deepseek_v3.model.model")
        import torchtitan.models.deepseek_v3 as package
        from torchtitan.config import JobConfig
        from torchtitan.models import attention
        from torchtitan.models.deepseek_v3.model.args import DeepSeekV3ModelArgs
        from torchtitan.models.moe import MoEArgs
    except ImportError as exc:
        pytest.skip(f"torchtitan cannot be imported ({exc}); install torchtitan==0.2.2 --no-deps")
    return {
        "model": model,
        "package": package,
        "JobConfig": JobConfig,
        "attention": attention,
        "Args": DeepSeekV3ModelArgs,
        "MoEArgs": MoEArgs,
    }


@pytest.fixture
def workdir():
    """A private scratch directory. Not pytest's tmp_path: its numbered base
    directories are pruned by other pytest sessions running at the same time, which
    can delete a directory a multi-rank run is still using."""
    import shutil
    import tempfile
    from pathlib import Path

    path = Path(tempfile.mkdtemp(prefix="titan-ds3-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)
