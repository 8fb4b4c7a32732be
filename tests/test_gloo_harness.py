"""titan_plugins.testing.gloo.run_ranks: values in rank order, one error naming the
failing rank, and the caller's environment in every rank (also when the ranks fork
from a fork server started by an earlier call, before the variable was set)."""

from __future__ import annotations

import multiprocessing
import os

import pytest

from titan_plugins.testing.gloo import RankFailure, run_ranks


def _all_reduce(rank: int, world: int, scale: float) -> tuple[int, list[float], str, str]:
    import torch
    import torch.distributed as dist

    t = torch.tensor([float(rank + 1), scale])
    dist.all_reduce(t)
    return dist.get_rank(), t.tolist(), os.environ["RANK"], os.environ.get("TITAN_GLOO_PROBE", "<unset>")


def _raise_on_one(rank: int, world: int) -> None:
    import torch
    import torch.distributed as dist

    if rank == 1:
        raise ValueError("boom on rank 1")
    dist.all_reduce(torch.ones(1))  # rank 0 waits for a peer that is gone


def test_values_errors_and_environment(monkeypatch):
    monkeypatch.delenv("TITAN_GLOO_PROBE", raising=False)
    got = run_ranks(_all_reduce, 2, 0.5, timeout=120)
    assert got == [(0, [3.0, 1.0], "0", "<unset>"), (1, [3.0, 1.0], "1", "<unset>")]

    with pytest.raises(RankFailure) as err:
        run_ranks(_raise_on_one, 2, timeout=120)
    text = str(err.value)
    assert text.startswith("rank 1 failed:") and "ValueError: boom on rank 1" in text, text
    assert err.value.rank == 1 and not multiprocessing.active_children()

    # set after the fork server started: a rank forked from it must still see it
    monkeypatch.setenv("TITAN_GLOO_PROBE", "after-the-server")
    got = run_ranks(_all_reduce, 2, 1.0, timeout=120)
    assert [g[3] for g in got] == ["after-the-server"] * 2


def test_rejects_a_function_ranks_cannot_import():
    with pytest.raises(ValueError, match="module-level"):
        run_ranks(lambda rank, world: None, 2)
