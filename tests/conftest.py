# --- titan runtime (tests/test_runtime_*.py) --------------------------------
import os
import sys

_TESTS = os.path.dirname(os.path.abspath(__file__))
if _TESTS not in sys.path:  # tiny_plugin.py lives here; ranks get it via PYTHONPATH
    sys.path.insert(0, _TESTS)
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TITAN_CPU_PEAK_TFLOPS", "off")  # no matmul probe per test run (peak.py)


def pytest_collection_modifyitems(config, items):
    """Multi-rank tests first (stable otherwise): under `make test`'s two xdist workers
    (--dist loadfile) the files holding the longest runs start early instead of leaving
    one worker busy alone at the end."""
    def weight(item):
        return 0 if item.get_closest_marker("slow") or item.get_closest_marker("titan_slow") else 1

    items.sort(key=weight)
