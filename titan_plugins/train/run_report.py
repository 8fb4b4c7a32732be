"""What a person reads on rank 0's console: a run header before the first step, an
ETA on each step line, and a run summary after the last step.

The formatting is pure functions (``header_lines``, ``summary_lines``,
``format_duration``, ``format_count``, ``eta_seconds``); ``RunReport`` gathers what
they need from the trainer and prints on rank 0 only when ``metrics.console`` is on.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from titan_plugins.distributed.parallel_dims import ParallelDims

__all__ = [
    "RunReport",
    "RunStats",
    "count_parameters",
    "eta_seconds",
    "format_count",
    "format_duration",
    "header_lines",
    "summary_lines",
]


# ------------------------------------------------------------------ formatting
def format_count(n: float) -> str:
    """``1234567`` -> ``1.23M`` (K, M, B, T; plain below a thousand)."""
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f}{unit}"
    return f"{n:.0f}"


def format_duration(seconds: float) -> str:
    """``3725`` -> ``1h02m05s``; ``65.4`` -> ``1m05s``; ``4.2`` -> ``4.2s``."""
    if not math.isfinite(seconds):
        return "?"
    seconds = max(0.0, seconds)
    if seconds < 10:
        return f"{seconds:.1f}s"
    s = int(round(seconds))
    h, rest = divmod(s, 3600)
    m, s = divmod(rest, 60)
    if h:
        return f"{h}h{m:02d}m{s:02d}s"
    return f"{m}m{s:02d}s" if m else f"{s}s"


def eta_seconds(step: int, total_steps: int, first_step: int, first_time: float, now: float,
                last_step_time: float) -> float:
    """Time left after ``step`` of ``total_steps``: the mean wall time per step since the
    end of ``first_step`` (which carries start-up and compilation, so it is left out),
    or the last step's time while there is no later step to average."""
    left = max(0, total_steps - step)
    per_step = (now - first_time) / (step - first_step) if step > first_step else last_step_time
    return left * per_step


def header_lines(
    *,
    model: str,
    flavor: str,
    params_total: int,
    params_active: int,
    world: str,
    meshes: str,
    device: str,
    precision: str,
    global_batch_seqs: int,
    seq_len: int,
    steps: int,
    start_step: int,
    run_dir: str,
    tensorboard: str | None,
    metrics_jsonl: str | None,
    data: str | None = None,
    tokenizer: str | None = None,
    schedule: str | None = None,
    peak: str | None = None,
    extra: list[str] | None = None,
) -> list[str]:
    """The run header: what trains, on what, with how much, and where its outputs go."""
    params = f"{format_count(params_total)} total"
    if params_active != params_total:
        params += f", {format_count(params_active)} active per token"
    tokens = global_batch_seqs * seq_len
    resume = f" (resuming after step {start_step})" if start_step else ""
    rows = [
        ("model", f"{model} ({flavor if ' ' in flavor else 'flavor ' + flavor}), {params} parameters"),
        ("world", f"{world} on {device}"),
        ("meshes", meshes),
        ("precision", precision),
        ("batch", f"{global_batch_seqs} sequences x {seq_len} tokens = {tokens:,} tokens per step"),
        ("steps", f"{steps}{resume}"),
        *((("data", data),) if data else ()),
        *((("tokenizer", tokenizer),) if tokenizer else ()),
        *((("lr", schedule),) if schedule else ()),
        *((("peak", peak),) if peak else ()),
        ("run dir", run_dir),
        ("metrics", metrics_jsonl or "off (metrics.jsonl=false)"),
        ("tensorboard", f"tensorboard --logdir {tensorboard}" if tensorboard else "off"),
    ]
    return _boxed([f"{k:<12}{v}" for k, v in rows] + list(extra or []))


def _boxed(lines: list[str]) -> list[str]:
    rule = "=" * min(max(len(line) for line in lines), 100)
    return [rule, *lines, rule]


@dataclass
class RunStats:
    """What the summary reports; ``update`` takes each step's metrics."""

    start_time: float
    start_step: int = 0
    last_step: int = 0
    first_step_end: float | None = None
    final_loss: float | None = None
    best_loss: float | None = None
    best_step: int | None = None
    tokens: float = 0.0
    step_seconds: float = 0.0
    peak_memory_gib: float = 0.0
    step_times: list[float] = field(default_factory=list)
    validation: tuple[int, float] | None = None  # (step, loss) of the last validation
    data_counts: str | None = None  # what the data source counted (chat: truncated, dropped, ...)
    nonfinite: str | None = None  # training.nonfinite=skip: the steps it skipped (train/nonfinite.py)
    objective: str | None = None  # the objective's own metrics at the last step (dpo: rewards/*)

    def update(self, step: int, metrics: dict[str, float], now: float, total_steps: int) -> float:
        """Record one step; return the ETA in seconds."""
        if self.first_step_end is None:
            self.first_step_end = now
            first = step
        else:
            first = self.start_step + 1
        loss = metrics.get("loss")
        if loss is not None:
            self.final_loss = loss
            if self.best_loss is None or loss < self.best_loss:
                self.best_loss, self.best_step = loss, step
        dt = metrics.get("step_time_s", 0.0)
        self.tokens += metrics.get("tokens_per_s", 0.0) * dt
        self.step_seconds += dt
        self.peak_memory_gib = max(self.peak_memory_gib, metrics.get("memory_gib", 0.0))
        self.last_step = step
        return eta_seconds(step, total_steps, first, self.first_step_end, now, dt)


def summary_lines(stats: RunStats, now: float, *, memory_kind: str, checkpoint: str | None) -> list[str]:
    """The run summary after the last step."""
    wall = now - stats.start_time
    ran = stats.last_step - stats.start_step
    rows = [("finished", f"step {stats.last_step} ({ran} steps in this run), "
                         f"wall time {format_duration(wall)}")]
    if stats.final_loss is not None:
        rows.append(("loss", f"final {stats.final_loss:.4f}, best {stats.best_loss:.4f} at step {stats.best_step}"))
    if stats.validation is not None:
        rows.append(("validation", f"loss {stats.validation[1]:.4f} at step {stats.validation[0]}"))
    if stats.data_counts:
        rows.append(("data", stats.data_counts))
    if stats.nonfinite:
        rows.append(("non-finite", stats.nonfinite))
    if stats.objective:
        rows.append(("objective", stats.objective))
    if stats.step_seconds > 0:
        rows.append(("throughput", f"{stats.tokens / stats.step_seconds:,.0f} tokens/s, all ranks "
                                   f"({format_count(stats.tokens)} tokens in {format_duration(stats.step_seconds)} of steps)"))
    rows.append(("memory", f"peak {stats.peak_memory_gib:.2f} GiB ({memory_kind}, rank 0)"))
    rows.append(("checkpoint", checkpoint or "none saved"))
    return _boxed([f"{k:<12}{v}" for k, v in rows])


# ------------------------------------------------------------------ counting
def count_parameters(model: Any) -> tuple[int, int]:
    """``(total, active per token)`` of a model (meta tensors are fine). A module with
    ``experts.num_experts`` and ``router.top_k`` (the core's MoE layout) counts only
    ``top_k / num_experts`` of its routed experts as active."""
    total = sum(p.numel() for p in model.parameters())
    inactive = 0.0
    for module in model.modules():
        experts, router = getattr(module, "experts", None), getattr(module, "router", None)
        n, k = getattr(experts, "num_experts", None), getattr(router, "top_k", None)
        if isinstance(n, int) and isinstance(k, int) and n > 0 and hasattr(experts, "parameters"):
            inactive += sum(p.numel() for p in experts.parameters()) * (1 - k / n)
    return total, int(round(total - inactive))


def _enum(value: Any) -> str:
    return str(getattr(value, "value", value))


def _precision_text(precision: Any) -> str:
    text = (f"{precision.name}: weights {_enum(precision.weight_dtype)}, params {_enum(precision.param_dtype)}, "
            f"reduce {_enum(precision.reduce_dtype)}")
    if precision.get("compute_dtype") is not None:
        text += f", compute {_enum(precision.compute_dtype)}"
    return text


def _data_text(data: Any) -> str:
    name = str(data.get("name"))
    if name == "mix":
        return "mix of " + ", ".join(f"{e.get('name')}:{e.get('path')} x{e.get('weight', 1)}"
                                     for e in (data.get("mix") or []))
    return f"{name} ({data.get('path')})" if data.get("path") else name


def _tokenizer_text(data: Any, tokenizer: Any) -> str:
    where = data.get("tokenizer") or "the shipped tokenizer"
    vocab = getattr(tokenizer, "vocab_size", None)
    return f"{where}, vocab {vocab:,}" if vocab else str(where)


def _schedule_text(training: Any) -> str:
    decay = _enum(training.decay)
    text = f"{float(training.lr):.3g}, warmup {int(training.warmup_steps)} steps"
    if decay != "none":
        text += f", {decay} decay to {float(training.lr) * float(training.min_lr_ratio):.3g}"
    return text


def _meshes_text(dims: ParallelDims) -> str:
    degrees = {k: getattr(dims, k) for k in ("dp_replicate", "dp_shard", "cp", "tp", "pp", "ep", "etp")}
    used = [f"{k}={v}" for k, v in degrees.items() if v > 1]
    return " x ".join(used) if used else "single rank (no parallelism)"


# ------------------------------------------------------------------ the trainer's side
class RunReport:
    """Created by the trainer before its first step; ``step`` returns each step's ETA,
    ``finish`` prints the summary. Prints on rank 0 only, when ``metrics.console``."""

    def __init__(self, trainer: Any, start_step: int) -> None:
        self.trainer = trainer
        job = trainer.job
        self.total_steps = int(job.training.steps)
        self.active = trainer.rank == 0 and bool(job.metrics.console)
        self.stats = RunStats(start_time=time.perf_counter(), start_step=start_step)
        if self.active:
            print("\n".join(header_lines(**self._header_fields(start_step))), flush=True)

    def _header_fields(self, start_step: int) -> dict[str, Any]:
        from titan_plugins.model.lifecycle import build_meta_model

        t = self.trainer
        job, dims = t.job, t.dims
        total, active = count_parameters(build_meta_model(t.spec, job))
        run_dir = Path(t.run_dir)
        global_batch = int(job.training.local_batch_size) * dims.dp_size * int(job.training.grad_accum_steps)
        ft = job.get("fault_tolerance")
        groups = int(ft.replica_groups) if ft is not None and ft.enable else 1
        global_batch *= groups  # fault_tolerance=torchft: the live groups share every group's rows
        return dict(
            model=t.spec.name,
            flavor=(f"sizes and weights from model.hf={job.model.hf}" if job.model.get("hf")
                    else f"flavor {job.model.get('flavor') or t.spec.default_flavor}"),
            params_total=total,
            params_active=active,
            world=f"{t.world} rank{'s' if t.world > 1 else ''}" + (
                f" per replica group, {groups} groups (fault_tolerance=torchft)" if groups > 1 else ""),
            meshes=_meshes_text(dims),
            device=t.device.type,
            precision=_precision_text(job.precision),
            global_batch_seqs=global_batch,
            seq_len=int(job.training.seq_len),
            steps=self.total_steps,
            start_step=start_step,
            run_dir=str(run_dir),
            tensorboard=str(run_dir / "tensorboard") if job.metrics.tensorboard else None,
            metrics_jsonl=str(run_dir / "metrics.jsonl") if job.metrics.jsonl else None,
            data=_data_text(job.data),
            tokenizer=_tokenizer_text(job.data, getattr(t, "tokenizer", None)),
            schedule=_schedule_text(job.training),
            peak=(f"{t.peak_tflops:.3g} TFLOP/s per rank ({t.peak_source}), for MFU"
                  if getattr(t, "peak_tflops", None) else "unknown (MFU not shown)"),
            extra=[*([f"{'objective':<12}{t.objective_text}"] if getattr(t, "objective_text", None) else []),
                   *([f"{'verified':<12}{job.model.verified}"] if job.model.get("verified") else [])] or None,
        )

    def validation(self, step: int, metrics: dict[str, float]) -> None:
        """Record a validation's loss for the summary."""
        self.stats.validation = (step, float(metrics["loss"]))

    def step(self, step: int, metrics: dict[str, float]) -> float:
        """Record a finished step; returns the seconds left (the console shows it)."""
        return self.stats.update(step, metrics, time.perf_counter(), self.total_steps)

    def finish(self) -> None:
        if not self.active:
            return
        ckpt = self.trainer.checkpointer
        saved = ckpt.checkpoints() if getattr(ckpt, "enabled", False) else []
        memory_kind = "device allocations" if self.trainer.device.type == "cuda" else "max RSS"
        lines = summary_lines(self.stats, time.perf_counter(), memory_kind=memory_kind,
                              checkpoint=str(saved[-1][1]) if saved else None)
        print("\n".join(lines), flush=True)
