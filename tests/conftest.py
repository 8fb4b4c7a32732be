# --- titan runtime (tests/test_runtime_*.py) --------------------------------
import os
import sys

_TESTS = os.path.dirname(os.path.abspath(__file__))
if _TESTS not in sys.path:  # tiny_plugin.py lives here; ranks get it via PYTHONPATH
    sys.path.insert(0, _TESTS)
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TITAN_CPU_PEAK_TFLOPS", "off")  # no matmul probe per test run (peak.py)
