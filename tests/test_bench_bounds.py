"""benchmarks/bench_bounds.py's trace arithmetic: nested and overlapping kernels count once."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_bounds.py"


@pytest.fixture(scope="module")
def bounds():
    sys.path.insert(0, str(BENCH.parent))
    try:
        spec = importlib.util.spec_from_file_location("bench_bounds", BENCH)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.path.remove(str(BENCH.parent))


def _op(name, ts, dur, tid=1, cat="cpu_op"):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid}


def test_covered_merges_overlaps(bounds):
    assert bounds._covered([(0, 10), (2, 5), (8, 12), (20, 25)]) == 17
    assert bounds._covered([]) == 0


def test_kernel_share_per_step(bounds, tmp_path):
    events = [
        _op("ProfilerStep#4", 0, 1000, cat="user_annotation"),
        _op("aten::linear", 0, 300),
        _op("aten::mm", 10, 200),  # inside linear: only the mm counts
        _op("aten::_grouped_mm", 400, 100),
        _op("aten::mm", 420, 50),  # a grouped mm's per-expert mm: counted once
        _op("aten::mul", 600, 100),
        _op("aten::_scaled_dot_product_flash_attention_for_cpu_backward", 700, 100, tid=2),
        _op("ProfilerStep#5", 1000, 500, cat="user_annotation"),
        _op("aten::bmm", 1100, 250),
    ]
    trace = tmp_path / "rank0.1.pt.trace.json"
    trace.write_text(json.dumps({"traceEvents": events}))
    rows = bounds.kernel_share(trace)
    assert rows == [{"step_s": 1000e-6, "kernel_s": 400e-6}, {"step_s": 500e-6, "kernel_s": 250e-6}]
