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
from typing import TYPE_CHECKING

import torch

from titan_plugins.hookspecs import hookimpl
from titan_plugins.train.peak import default_peak_tflops, peak_tflops_for_name
from titan_plugins.train.run_report import format_duration

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from titan_plugins.plugins import TitanPluginManager

__all__ = ["ConsoleSink", "JsonlSink", "TensorBoardSink", "default_peak_tflops", "memory_gib", "peak_tflops_for_name", "register_sinks"]

# The device peak table and the CPU probe live in titan_plugins.train.peak; re-exported
# here for the callers that import them from metrics.


def memory_gib(device_type: str) -> float:
    """Peak memory of this rank: device allocations on CUDA, max RSS on CPU."""
    if device_type == "cuda" and torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return rss / 2**20 if sys.platform != "darwin" else rss / 2**30


OBJECTIVE_PLAIN = ("reward", "reward_std", "kl", "entropy")  # objective metrics TRL names without a namespace


class ConsoleSink:
    """One line per ``metrics.log_freq`` steps on rank 0."""

    @hookimpl
    def titan_on_step_end(self, step: int, metrics: dict[str, float], job_config: DictConfig, rank: int) -> None:
        cfg = job_config.metrics
        if rank != 0 or not cfg.console:
            return
        if step % max(1, int(cfg.log_freq)) and step != int(job_config.training.steps):
            return
        total = int(job_config.training.steps)
        parts = [
            f"step {step:>{len(str(total))}}/{total}",
            f"loss {metrics['loss']:.4f}",
            f"grad_norm {metrics['grad_norm']:.4f}",
            f"lr {metrics['lr']:.2e}",
            f"tok/s (all ranks) {metrics['tokens_per_s']:,.0f}",
            f"TFLOP/s per rank {metrics['tflops']:.3f}",
        ]
        if "mfu" in metrics:
            parts.append(f"MFU {metrics['mfu']:.1f}%")
        # An objective's own metrics are namespaced (dpo: rewards/margins, logps/chosen, ...), but for
        # the few TRL logs unnamespaced (grpo: reward, reward_std, kl, entropy), which go first
        parts.extend(f"{key} {metrics[key]:.4g}" for key in OBJECTIVE_PLAIN if key in metrics)
        parts.extend(f"{key} {metrics[key]:.4g}" for key in sorted(metrics) if "/" in key)
        parts.append(f"mem {metrics['memory_gib']:.2f} GiB")
        if "eta_s" in metrics:
            parts.append(f"ETA {format_duration(metrics['eta_s'])}")
        print(" | ".join(parts), flush=True)


    @hookimpl
    def titan_on_validation_end(self, step: int, metrics: dict[str, float], job_config: DictConfig, rank: int) -> None:
        if rank == 0 and job_config.metrics.console:
            if "perplexity" in metrics:  # objective=sft
                print(f"validation at step {step:>5} | loss {metrics['loss']:.4f} | "
                      f"perplexity {metrics['perplexity']:.2f} | tokens {metrics['tokens']:,.0f}", flush=True)
                return
            rest = " | ".join(f"{k} {v:.4g}" for k, v in metrics.items() if k != "loss")  # another objective's
            print(f"validation at step {step:>5} | loss {metrics['loss']:.4f} | {rest}", flush=True)


class JsonlSink:
    """``<run_dir>/metrics.jsonl``: a ``start`` record, then one record per step."""

    def __init__(self) -> None:
        self._file = None

    @hookimpl
    def titan_on_train_start(self, job_config: DictConfig, run_dir: str, rank: int) -> None:
        if rank != 0 or not job_config.metrics.jsonl:
            return
        self._file = open(Path(run_dir) / "metrics.jsonl", "a", buffering=1)  # noqa: SIM115

    @hookimpl
    def titan_on_step_end(self, step: int, metrics: dict[str, float], job_config: DictConfig, rank: int) -> None:
        if self._file is not None:
            self._file.write(json.dumps({"step": step, **metrics}) + "\n")

    @hookimpl
    def titan_on_validation_end(self, step: int, metrics: dict[str, float], job_config: DictConfig, rank: int) -> None:
        if self._file is not None:  # a record of its own kind: readers of step losses skip it
            self._file.write(json.dumps({"validation_step": step, **metrics}) + "\n")

    @hookimpl
    def titan_on_train_end(self, step: int, metrics: dict[str, float], job_config: DictConfig, rank: int) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


class TensorBoardSink:
    """Event files under ``<run_dir>/tensorboard``."""

    def __init__(self) -> None:
        self._writer = None

    @hookimpl
    def titan_on_train_start(self, job_config: DictConfig, run_dir: str, rank: int) -> None:
        if rank != 0 or not job_config.metrics.tensorboard:
            return
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(log_dir=os.path.join(run_dir, "tensorboard"))

    @hookimpl
    def titan_on_step_end(self, step: int, metrics: dict[str, float], job_config: DictConfig, rank: int) -> None:
        if self._writer is None:
            return
        for key, value in metrics.items():
            self._writer.add_scalar(f"train/{key}", value, step)

    @hookimpl
    def titan_on_validation_end(self, step: int, metrics: dict[str, float], job_config: DictConfig, rank: int) -> None:
        if self._writer is not None:
            for key, value in metrics.items():
                self._writer.add_scalar(f"validation/{key}", value, step)

    @hookimpl
    def titan_on_train_end(self, step: int, metrics: dict[str, float], job_config: DictConfig, rank: int) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


def register_sinks(pm: TitanPluginManager) -> None:
    """Register the built-in sinks (once per manager)."""
    from titan_plugins.train.sinks import optional_sinks  # MLflow, W&B: idle unless enabled

    for name, sink in (("titan.console", ConsoleSink()), ("titan.jsonl", JsonlSink()),
                       ("titan.tensorboard", TensorBoardSink()), *optional_sinks()):
        if pm.get_plugin(name) is None:
            pm.register(sink, name=name)
