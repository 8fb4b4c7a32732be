"""The device's peak TFLOP/s for MFU, in the dtype the run computes in.

GPUs: a table of dense (no sparsity) peaks per device variant and dtype from the
vendors' data sheets, looked up from ``torch.cuda.get_device_name()``. CPUs: a
measured peak, a short matmul probe with the run's intra-op threads, cached per
CPU model, thread count and torch version under the user's cache directory
(``$XDG_CACHE_HOME/titan-plugins`` or ``~/.cache/titan-plugins``).
``metrics.peak_tflops`` overrides both; ``TITAN_CPU_PEAK_TFLOPS`` presets
(``0.2``, ``fp32=0.2,bf16=0.9``) or disables (``off``) the CPU probe.
"""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from omegaconf import DictConfig

__all__ = [
    "CPU_PEAK_ENV",
    "cpu_peak_tflops",
    "default_peak_tflops",
    "dtype_key",
    "measure_matmul_tflops",
    "mfu_percent",
    "peak_tflops_for_name",
    "precision_dtype",
    "run_peak_tflops",
]

CPU_PEAK_ENV = "TITAN_CPU_PEAK_TFLOPS"

# Dense TFLOP/s per device variant: bf16, fp8 where the tensor cores have it, and
# fp32 at the plain FP32 rate (torch's default matmul precision, TF32 off). fp16
# equals bf16 unless given. Matched case-insensitively as substrings of the device
# name, most specific first ("L40S" before "L40" before "L4", "A100" before "A10").
_PEAKS: tuple[tuple[str, dict[str, float]], ...] = (
    ("GB200", {"bf16": 2500.0, "fp8": 5000.0, "fp32": 80.0}),
    ("B200", {"bf16": 2250.0, "fp8": 4500.0, "fp32": 75.0}),
    ("GH200", {"bf16": 989.0, "fp8": 1979.0, "fp32": 67.0}),
    ("H200 NVL", {"bf16": 835.0, "fp8": 1671.0, "fp32": 60.0}),
    ("H200", {"bf16": 989.0, "fp8": 1979.0, "fp32": 67.0}),
    ("H100 NVL", {"bf16": 835.0, "fp8": 1671.0, "fp32": 60.0}),
    ("H100 PCIe", {"bf16": 756.0, "fp8": 1513.0, "fp32": 51.0}),
    ("H100", {"bf16": 989.0, "fp8": 1979.0, "fp32": 67.0}),  # "H100 80GB HBM3" = SXM
    ("H800", {"bf16": 989.0, "fp8": 1979.0, "fp32": 67.0}),
    ("A100", {"bf16": 312.0, "fp32": 19.5}),
    ("A800", {"bf16": 312.0, "fp32": 19.5}),
    ("L40S", {"bf16": 362.0, "fp8": 733.0, "fp32": 91.6}),
    ("L40", {"bf16": 181.0, "fp8": 362.0, "fp32": 90.5}),
    ("L4", {"bf16": 121.0, "fp8": 242.0, "fp32": 30.3}),
    ("A40", {"bf16": 150.0, "fp32": 37.4}),
    ("A10", {"bf16": 125.0, "fp32": 31.2}),
    ("V100", {"fp16": 125.0, "fp32": 15.7}),  # no bf16 tensor cores
    ("MI355X", {"bf16": 2500.0, "fp8": 5000.0, "fp32": 157.3}),
    ("MI350X", {"bf16": 2300.0, "fp8": 4600.0, "fp32": 144.2}),
    ("MI325X", {"bf16": 1307.0, "fp8": 2615.0, "fp32": 163.4}),
    ("MI300X", {"bf16": 1307.0, "fp8": 2615.0, "fp32": 163.4}),
    ("MI300A", {"bf16": 981.0, "fp8": 1961.0, "fp32": 122.6}),
    ("MI250X", {"bf16": 383.0, "fp32": 95.7}),
)

_DTYPE_KEYS = {
    "float32": "fp32", "fp32": "fp32", "float": "fp32",
    "bfloat16": "bf16", "bf16": "bf16",
    "float16": "fp16", "fp16": "fp16", "half": "fp16",
    "float8": "fp8", "fp8": "fp8", "float8_e4m3fn": "fp8",
}


def dtype_key(dtype: Any) -> str:
    """``torch.bfloat16`` / ``Dtype.bfloat16`` / ``"bf16"`` -> ``"bf16"`` (fp32, bf16, fp16, fp8)."""
    text = str(getattr(dtype, "value", dtype)).removeprefix("torch.")
    if text not in _DTYPE_KEYS:
        raise ValueError(f"no peak for dtype {text!r}")
    return _DTYPE_KEYS[text]


def peak_tflops_for_name(name: str, dtype: Any = "bf16") -> float | None:
    """Dense peak of a device name such as ``NVIDIA H100 PCIe`` in ``dtype``; None when
    the device or its dtype is unknown."""
    key, low = dtype_key(dtype), name.lower()
    for pattern, peaks in _PEAKS:
        if pattern.lower() in low:
            return peaks.get(key, peaks.get("bf16") if key == "fp16" else None)
    return None


def default_peak_tflops(device_type: str, dtype: Any = "bf16") -> float | None:
    """The table's peak for this process's CUDA device; None elsewhere."""
    if device_type != "cuda" or not torch.cuda.is_available():
        return None
    return peak_tflops_for_name(torch.cuda.get_device_name(), dtype)


def _get(node: Any, key: str) -> Any:
    return node.get(key) if hasattr(node, "get") else getattr(node, key, None)


def precision_dtype(precision: Any) -> str:
    """The dtype a ``precision`` group computes its matmuls in: float8 where set,
    else ``compute_dtype``, else FSDP's ``param_dtype`` when it is not fp32, else
    ``weight_dtype``."""
    if _get(precision, "float8"):
        return "fp8"
    compute = _get(precision, "compute_dtype")
    if compute is not None:
        return dtype_key(compute)
    param = dtype_key(_get(precision, "param_dtype") or "float32")
    return param if param != "fp32" else dtype_key(_get(precision, "weight_dtype") or "float32")


# ---------------------------------------------------------------------- CPU
def measure_matmul_tflops(dtype: torch.dtype = torch.float32, seconds: float = 0.3, n: int = 2048) -> float:
    """Best TFLOP/s of square ``n`` matmuls run for about ``seconds`` with torch's
    current intra-op threads. A 512 matmul first sizes ``n`` down where this dtype
    is slow (bf16 without hardware support), so the probe stays under ~1 s. Its inputs
    come from a generator of its own: only rank 0 probes (``run_peak_tflops``), and a
    draw from torch's global generator there would leave rank 0's random ops (dropout,
    PhiMoE's expert sampling) out of step with the other ranks' after the same seed."""
    gen = torch.Generator().manual_seed(0)
    small = torch.randn(512, 512, generator=gen).to(dtype)
    torch.mm(small, small)  # first call: thread pool and packing set-up
    start = time.perf_counter()
    torch.mm(small, small)
    rate = 2 * 512**3 / max(time.perf_counter() - start, 1e-9)
    while n > 512 and 2 * n**3 / rate > seconds / 3:
        n //= 2
    a, b = torch.randn(n, n, generator=gen).to(dtype), torch.randn(n, n, generator=gen).to(dtype)
    out = torch.mm(a, b)
    best, spent, iters = 0.0, 0.0, 0
    while spent < seconds or iters < 2:
        t0 = time.perf_counter()
        torch.mm(a, b, out=out)
        dt = max(time.perf_counter() - t0, 1e-9)
        best, spent, iters = max(best, 2 * n**3 / dt), spent + dt, iters + 1
    return best / 1e12


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown cpu"


def cache_path() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "titan-plugins" / "cpu_peak.json"


def _cache_key(threads: int) -> str:
    return f"{_cpu_model()} | threads {threads} | torch {torch.__version__}"


def _read_cache(path: Path) -> dict[str, dict[str, float]]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _write_cache(path: Path, key: str, dtype: str, value: float) -> None:
    data = _read_cache(path)
    data.setdefault(key, {})[dtype] = value
    try:  # best effort: a read-only home only means probing again next time
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
        os.replace(tmp, path)
    except OSError:
        pass


def _env_preset(dtype: str) -> tuple[bool, float | None]:
    """``(set, value)`` from ``TITAN_CPU_PEAK_TFLOPS``: ``off`` -> (True, None)."""
    raw = os.environ.get(CPU_PEAK_ENV, "").strip()
    if not raw:
        return False, None
    if raw.lower() in ("off", "0", "none", "false"):
        return True, None
    try:
        if "=" not in raw:
            return True, float(raw)
        pairs = dict(part.split("=", 1) for part in raw.split(",") if part.strip())
        by_key = {dtype_key(k.strip()): float(v) for k, v in pairs.items()}
    except ValueError:
        raise ValueError(f"{CPU_PEAK_ENV}={raw!r}: use off, a number, or fp32=X,bf16=Y") from None
    return True, by_key.get(dtype)


def cpu_peak_tflops(dtype: Any = "fp32", *, probe: bool = True, seconds: float = 0.3) -> float | None:
    """This CPU's matmul peak in ``dtype`` with torch's current thread count: the env
    preset, else the best of a fresh measurement (with ``probe``) and the cached best.

    A peak is the best ever observed: a probe taken while other work shares the cores
    reads low, so it never replaces a higher cached value, and a low value cached once
    (the load average lags a burst) is healed by the next quiet probe."""
    key = dtype_key(dtype)
    preset, value = _env_preset(key)
    if preset:
        return value
    if key == "fp8":
        return None  # no float8 matmuls on CPU
    path, threads = cache_path(), torch.get_num_threads()
    cached = float(_read_cache(path).get(_cache_key(threads), {}).get(key) or 0.0)
    if not probe:
        return cached or None
    value = measure_matmul_tflops({"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[key],
                                  seconds=seconds)
    if value > cached and not _busy():  # a probe on a loaded machine is used for this run only
        _write_cache(path, _cache_key(threads), key, value)
    return max(value, cached)


def _busy() -> bool:
    """More runnable processes than cores (1-minute load average), where available."""
    try:
        return os.getloadavg()[0] > (os.cpu_count() or 1)
    except OSError:
        return False


# ---------------------------------------------------------------------- run
def run_peak_tflops(job: DictConfig, device_type: str) -> float | None:
    """The peak the trainer divides by: ``metrics.peak_tflops`` if set, else the
    device's peak in the run's compute dtype. On CPU rank 0 measures (or reads the
    cache) while the others wait in a broadcast of its value, so no probe shares
    the cores with another rank's probe."""
    override = _get(job.metrics, "peak_tflops")
    if override:
        return float(override)
    dtype = precision_dtype(job.precision)
    if device_type != "cpu":
        return default_peak_tflops(device_type, dtype)
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return cpu_peak_tflops(dtype)
    value = torch.zeros(1, dtype=torch.float64)
    if dist.get_rank() == 0:
        value.fill_(cpu_peak_tflops(dtype) or 0.0)
    dist.broadcast(value, src=0)
    return float(value.item()) or None


def mfu_percent(tflops: float, peak_tflops: float | None) -> float | None:
    """MFU in percent, or None where it cannot be right: no peak, or a result above 100%
    (the peak is then not credible, e.g. a CPU probe taken while other work ran)."""
    if not peak_tflops:
        return None
    mfu = 100.0 * tflops / peak_tflops
    return mfu if mfu <= 100.0 else None

