"""torch.profiler traces and CUDA memory snapshots of chosen steps.

``profiling.enabled``: steps ``start_step .. start_step + steps - 1`` (global step
numbers, so a resumed run traces the same steps) are traced on every rank into
``<run_dir>/profile/rank<R>.<ms>.pt.trace.json`` (Chrome/Perfetto JSON, written by
``tensorboard_trace_handler``, so ``tensorboard --logdir <run_dir>/profile`` shows it
in the profiler plugin, and https://ui.perfetto.dev opens the file as it is).
The profiler's own C++ messages go to ``kineto_rank<R>.log`` beside the traces, not
between the step lines.

``profiling.memory_snapshot`` (CUDA only): the allocator's history is recorded from
the start of training and dumped to ``memory_snapshot_rank<R>_step<N>.pickle`` after
the traced steps (or the last step, if earlier), and to ``memory_snapshot_rank<R>_oom.pickle`` on an out-of-memory
error (drag either onto https://pytorch.org/memory_viz).
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from titan_plugins.errors import ConfigError

if TYPE_CHECKING:
    from omegaconf import DictConfig

__all__ = ["PROFILE_DIR", "StepProfiler", "check_profiling"]

PROFILE_DIR = "profile"
_MAX_HISTORY = 100_000  # allocator events kept (torch's documented example value)


def check_profiling(job: DictConfig) -> None:
    """One line naming the key for a value that cannot work (before any rank starts)."""
    cfg = job.get("profiling")
    if cfg is None or not (cfg.enabled or cfg.memory_snapshot):
        return
    for key in ("start_step", "steps"):
        if int(cfg[key]) < 1:
            raise ConfigError(f"profiling.{key}={cfg[key]} must be at least 1")


@contextlib.contextmanager
def _stderr_to(path: Path) -> Iterator[None]:
    """Send file descriptor 2 to ``path`` for the block: the profiler's C++ side (kineto)
    writes its start/stop lines there, which would otherwise break up the step lines."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(path, "ab") as log:
            os.dup2(log.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


class StepProfiler:
    """Made before the first step (``resumed_at``: the steps already done); the trainer
    calls ``step(n)`` after every step ``n`` and ``close(n)`` after the loop."""

    def __init__(self, job: DictConfig, run_dir: str, rank: int, device_type: str, resumed_at: int = 0) -> None:
        cfg = job.profiling
        self.trace = bool(cfg.enabled)
        self.snapshot = bool(cfg.memory_snapshot) and device_type == "cuda"
        if cfg.memory_snapshot and device_type != "cuda" and rank == 0:
            print("profiling.memory_snapshot: CUDA only; skipped on this device", flush=True)
        self.first, self.last = int(cfg.start_step), int(cfg.start_step) + int(cfg.steps) - 1
        self.cfg, self.rank, self.device_type = cfg, rank, device_type
        self.folder = Path(run_dir) / PROFILE_DIR
        self._prof: Any = None
        self._dumped = False
        if self.snapshot:  # from the start: an OOM in step 1 is the common case
            self._record(True)
            self._attach_oom_observer()
        self.step(resumed_at)

    def step(self, done: int) -> None:
        """``done`` steps are finished: start before step ``start_step``, stop after the last."""
        if self._prof is not None and done < self.last:
            self._prof.step()  # closes "ProfilerStep#<done>", opens the next
        if done + 1 == self.first:
            self._start()
        elif done == self.last:
            self.close(done)

    def close(self, done: int | None = None) -> None:
        if self._prof is not None:
            with _stderr_to(self.folder / f"kineto_rank{self.rank}.log"):
                self._prof.stop()  # tensorboard_trace_handler writes the file here
            self._prof = None
        if self.snapshot and done is not None and not self._dumped:
            self._dump(f"step{done}")  # recording goes on: an OOM later still has its history
            self._dumped = True

    # ---------------------------------------------------------------- torch
    def _start(self) -> None:
        if not self.trace:
            return
        self.folder.mkdir(parents=True, exist_ok=True)
        from torch.profiler import ProfilerAction, ProfilerActivity, profile
        from torch.profiler import tensorboard_trace_handler as trace_handler

        activities = [ProfilerActivity.CPU]
        if self.device_type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        self._prof = profile(
            activities=activities,
            record_shapes=bool(self.cfg.record_shapes),
            profile_memory=bool(self.cfg.profile_memory),
            with_stack=bool(self.cfg.with_stack),
            # a schedule (always record: start and stop are ours) makes torch mark the steps
            schedule=lambda _step: ProfilerAction.RECORD,
            on_trace_ready=trace_handler(str(self.folder), worker_name=f"rank{self.rank}"),
        )
        self._prof.step_num = self.first  # "ProfilerStep#N" is training step N
        with _stderr_to(self.folder / f"kineto_rank{self.rank}.log"):
            self._prof.start()

    def _record(self, on: bool) -> None:
        import torch

        torch.cuda.memory._record_memory_history(enabled="all" if on else None, max_entries=_MAX_HISTORY)

    def _dump(self, tag: str) -> None:
        import torch

        self.folder.mkdir(parents=True, exist_ok=True)
        torch.cuda.memory._dump_snapshot(str(self.folder / f"memory_snapshot_rank{self.rank}_{tag}.pickle"))

    def _attach_oom_observer(self) -> None:
        import torch

        def on_oom(device: int, alloc: int, device_alloc: int, device_free: int) -> None:
            self._dump("oom")  # the history up to the failed allocation

        attach = getattr(torch._C, "_cuda_attach_out_of_memory_observer", None)  # CUDA builds only
        if attach is not None:
            attach(on_oom)
