"""The parallelize hook on 4 gloo ranks (spawned here, no trainer) against one process:
FSDP x TP/SP x EP (ETP=1 and ETP=TP), tensor-parallel experts with EP off, EP without
TP, activation checkpointing, loss parallel on and off, both pipeline stages of a
pp=2 split, and bf16 compute. See _parallel_check.py for what each rank asserts."""

from __future__ import annotations

import socket
from pathlib import Path

import _parallel_check as check
import pytest


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_parallelize_matches_single_process(workdir: Path):
    import torch.multiprocessing as mp

    names = list(check.CASES)
    try:
        mp.spawn(check.worker, args=(4, _free_port(), names, str(workdir)), nprocs=4, join=True)
    except Exception as exc:
        errors = sorted(workdir.glob("error.*.txt"))
        detail = errors[0].read_text()[-3000:] if errors else ""
        pytest.fail(f"a rank failed: {exc}\n{detail}")
    results = (workdir / "results.txt").read_text()
    print(results)
    assert [line.split(":")[0] for line in results.splitlines()] == names
