"""Step metrics and the built-in sinks (console, JSONL, TensorBoard).

The sinks are plugin objects registered on the plugin manager like any other
``titan_on_step_end`` implementation; the trainer only calls the hooks. They act
on rank 0. ``metrics.jsonl`` floats are written with ``repr`` (``json`` does), so
they read back bit-exact.
"""

from __future__ import annotations

import json
import os
import resource
import sys
from pathlib import Path
from typing import Any

import torch

from titan_plugins.hookspecs import hookimpl

__all__ = ["ConsoleSink", "JsonlSink", "TensorBoardSink", "default_peak_tflops", "memory_gib", "peak_tflops_for_name", "register_sinks"]

# Dense (no sparsity) bf16 peak TFLOP/s per device variant for MFU when metrics.peak_tflops is unset,
# from the vendors' data sheets. Matched as substrings of the device name, most specific first.
_PEAKS: tuple[tuple[str, float], ...] = (
    ("GB200", 2500.0), ("B200", 2250.0), ("H200", 989.0),
    ("H100 NVL", 835.0), ("H100 PCIe", 756.0), ("H100", 989.0),  # plain "H100" / "H100 80GB HBM3" = SXM
    ("A100", 312.0), ("L40S", 362.0), ("L4", 121.0), ("A10", 125.0), ("V100", 125.0),
    ("MI355X", 2500.0), ("MI325X", 1307.0), ("MI300X", 1307.0), ("MI300A", 980.0), ("MI250X", 383.0),
)


def peak_tflops_for_name(name: str) -> float | None:
    """Dense bf16 peak for a device name such as ``NVIDIA H100 PCIe``; None when unknown."""
    low = name.lower()
    return next((v for k, v in _PEAKS if k.lower() in low), None)


def default_peak_tflops(device_type: str) -> float | None:
    if device_type != "cuda" or not torch.cuda.is_available():
        return None
    return peak_tflops_for_name(torch.cuda.get_device_name())


def memory_gib(device_type: str) -> float:
    """Peak memory of this rank: device allocations on CUDA, max RSS on CPU."""
    if device_type == "cuda" and torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return rss / 2**20 if sys.platform != "darwin" else rss / 2**30


class ConsoleSink:
    """One line per ``metrics.log_freq`` steps on rank 0."""

    @hookimpl
    def titan_on_step_end(self, step: int, metrics: dict[str, float], job_config: Any, rank: int) -> None:
        cfg = job_config.metrics
        if rank != 0 or not cfg.console:
            return
        if step % max(1, int(cfg.log_freq)) and step != int(job_config.training.steps):
            return
        parts = [
            f"step {step:>5}",
            f"loss {metrics['loss']:.4f}",
            f"grad_norm {metrics['grad_norm']:.4f}",
            f"lr {metrics['lr']:.2e}",
            f"tok/s {metrics['tokens_per_s']:,.0f}",
            f"TFLOP/s {metrics['tflops']:.3f}",
        ]
        if "mfu" in metrics:
            parts.append(f"MFU {metrics['mfu']:.1f}%")
        parts.append(f"mem {metrics['memory_gib']:.2f} GiB")
        print(" | ".join(parts), flush=True)


    @hookimpl
    def titan_on_validation_end(self, step: int, metrics: dict[str, float], job_config: Any, rank: int) -> None:
        if rank == 0 and job_config.metrics.console:
            print(f"validation at step {step:>5} | loss {metrics['loss']:.4f} | "
                  f"perplexity {metrics['perplexity']:.2f} | tokens {metrics['tokens']:,.0f}", flush=True)


class JsonlSink:
    """``<run_dir>/metrics.jsonl``: a ``start`` record, then one record per step."""

    def __init__(self) -> None:
        self._file = None

    @hookimpl
    def titan_on_train_start(self, job_config: Any, run_dir: str, rank: int) -> None:
        if rank != 0 or not job_config.metrics.jsonl:
            return
        self._file = open(Path(run_dir) / "metrics.jsonl", "a", buffering=1)  # noqa: SIM115

    @hookimpl
    def titan_on_step_end(self, step: int, metrics: dict[str, float], job_config: Any, rank: int) -> None:
        if self._file is not None:
            self._file.write(json.dumps({"step": step, **metrics}) + "\n")

    @hookimpl
    def titan_on_validation_end(self, step: int, metrics: dict[str, float], job_config: Any, rank: int) -> None:
        if self._file is not None:  # a record of its own kind: readers of step losses skip it
            self._file.write(json.dumps({"validation_step": step, **metrics}) + "\n")

    @hookimpl
    def titan_on_train_end(self, step: int, metrics: dict[str, float], job_config: Any, rank: int) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


class TensorBoardSink:
    """Event files under ``<run_dir>/tensorboard``."""

    def __init__(self) -> None:
        self._writer = None

    @hookimpl
    def titan_on_train_start(self, job_config: Any, run_dir: str, rank: int) -> None:
        if rank != 0 or not job_config.metrics.tensorboard:
            return
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(log_dir=os.path.join(run_dir, "tensorboard"))

    @hookimpl
    def titan_on_step_end(self, step: int, metrics: dict[str, float], job_config: Any, rank: int) -> None:
        if self._writer is None:
            return
        for key, value in metrics.items():
            self._writer.add_scalar(f"train/{key}", value, step)

    @hookimpl
    def titan_on_validation_end(self, step: int, metrics: dict[str, float], job_config: Any, rank: int) -> None:
        if self._writer is not None:
            for key, value in metrics.items():
                self._writer.add_scalar(f"validation/{key}", value, step)

    @hookimpl
    def titan_on_train_end(self, step: int, metrics: dict[str, float], job_config: Any, rank: int) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


def register_sinks(pm: Any) -> None:
    """Register the built-in sinks (once per manager)."""
    for name, sink in (("titan.console", ConsoleSink()), ("titan.jsonl", JsonlSink()),
                       ("titan.tensorboard", TensorBoardSink())):
        if pm.get_plugin(name) is None:
            pm.register(sink, name=name)
