"""The parallelize hook on 4 gloo ranks (``run_ranks``, no trainer) against one process:
FSDP x TP/SP x EP (ETP=1 and ETP=TP), tensor-parallel experts with EP off, EP without
TP, activation checkpointing, loss parallel on and off, both pipeline stages of a
pp=2 split, and bf16 compute. See _parallel_check.py for what each rank asserts."""

from __future__ import annotations

import _parallel_check as check
import pytest

from titan_plugins.testing.gloo import run_ranks


@pytest.mark.slow
def test_parallelize_matches_single_process():
    names = list(check.CASES)
    results = "\n".join(run_ranks(check.worker, 4, names)[0])
    print(results)
    assert [line.split(":")[0] for line in results.splitlines()] == names
