"""The training loop of one rank.

Per step: fetch ``grad_accum_steps`` microbatches, count the global label tokens
(all-reduced over DP), forward/backward each microbatch (or run the pipeline
schedule), clip the gradient norm over all meshes, step AdamW and the LR
schedule, reduce the loss for logging, and call ``titan_on_step_end``.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from titan_plugins.checkpoint.checkpointer import (
    Checkpointer,
    full_model_state_dict,
    load_model_weights,
)
from titan_plugins.config.hydra_glue import model_config
from titan_plugins.distributed.clip_grad import clip_grad_norm_
from titan_plugins.distributed.parallel_dims import ParallelDims, default_device_and_backend
from titan_plugins.model.lifecycle import ModelParts, build_model_parts
from titan_plugins.model.optimizer import build_lr_scheduler, build_optimizer
from titan_plugins.objectives.step import primary, run_microbatches
from titan_plugins.spec import ModelSpec
from titan_plugins.train.metrics import memory_gib
from titan_plugins.train.nonfinite import NonFiniteGuard
from titan_plugins.train.peak import mfu_percent, run_peak_tflops
from titan_plugins.train.preemption import Preemption
from titan_plugins.train.profiling import StepProfiler
from titan_plugins.train.run_report import RunReport
from titan_plugins.train.validation import Validator

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from titan_plugins.data.loader import DataLoader
    from titan_plugins.plugins import TitanPluginManager

__all__ = ["Trainer", "init_distributed", "set_determinism"]


def set_determinism(job: DictConfig) -> None:
    seed = int(job.training.seed)
    torch.manual_seed(seed)
    if job.training.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        if torch.cuda.is_available():
            torch.backends.cudnn.deterministic = True
            torch.backends.cudnn.benchmark = False


def init_distributed(job: DictConfig) -> tuple[ParallelDims, torch.device]:
    """Process group + meshes for this rank (RANK/WORLD_SIZE from the launcher)."""
    device_type, backend = default_device_and_backend(job.parallelism.device, job.parallelism.backend)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device_type == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        if backend == "nccl":
            backend = "cpu:gloo,cuda:nccl"  # gather_object and small CPU collectives too
    else:
        device = torch.device(device_type)
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "localhost")
        os.environ.setdefault("MASTER_PORT", "29500")
        os.environ.setdefault("RANK", "0")
        dist.init_process_group(backend=backend, world_size=world, rank=int(os.environ["RANK"]))
    dims = ParallelDims.from_config(job.parallelism, world)
    dims.build_meshes(device_type)
    return dims, device


class Trainer:
    def __init__(self, spec: ModelSpec, job: DictConfig, pm: TitanPluginManager, run_dir: str | os.PathLike) -> None:
        self.spec, self.job, self.pm, self.run_dir = spec, job, pm, str(run_dir)
        self.dims, self.device = init_distributed(job)
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        set_determinism(job)
        self.steps = int(job.training.steps)
        self.accum = int(job.training.grad_accum_steps)
        from titan_plugins.objectives.registry import build_objective

        # The loss lives behind the objective (objective=sft by default: titan_plugins/objectives).
        self.objective = build_objective(job.get("objective"))
        self.model: ModelParts = build_model_parts(spec, job, self.dims, self.device, pm,
                                                   self.objective.pipeline_loss())
        if job.checkpoint.init_from:
            load_model_weights(self.model.parts, job.checkpoint.init_from)
        elif job.model.get("hf"):  # each rank reads only its shards' slices
            from titan_plugins.hf.load import load_hf_weights

            load_hf_weights(self.model.parts, spec, model_config(job.model, spec), job.model.hf,
                            partial=bool(job.model.get("hf_partial")))
        if job.get("peft") is not None and job.peft.get("init_from"):  # a PEFT adapter to continue
            from titan_plugins.peft.checkpoint import load_adapter_folder

            load_adapter_folder(self.model.parts, spec, model_config(job.model, spec), job)
        # before the reference: a precomputed reference also scores the validator's rows,
        # under the loss context the train step uses (loss_context), summed over DP
        self.dp_group = self.dims.mesh("dp").get_group() if self.dims.dp_enabled else None
        self.pp_group = self.dims.mesh("pp").get_group() if self.dims.pp_enabled else None
        self.loss_parallel = self.dims.tp_enabled and bool(job.parallelism.loss_parallel)
        self.validator = Validator(self) if job.validation.enabled else None
        self.reference = None
        if self.objective.needs_reference:  # from the starting weights, loaded above
            from titan_plugins.objectives.reference import build_reference

            self.reference = build_reference(self)
        self.objective_text = self.objective.describe() + (
            f"; reference: {self.reference.kind}" if self.reference is not None else "")
        self.step_metrics: dict[str, float] = {}

        self.optimizers = [build_optimizer(part, job.training) for part in self.model.parts]
        self.schedulers = [build_lr_scheduler(opt, job.training) for opt in self.optimizers]
        hooks_ref = spec.load("optimizer_hooks")
        if hooks_ref is not None:
            for fn in hooks_ref(self.model.parts, self.dims) or []:
                self.optimizers[0].register_step_pre_hook(lambda *_args, _fn=fn: _fn())

        self.dataloader = self.build_dataloader()
        self.checkpointer = Checkpointer(
            job, run_dir, self.model.parts, self.optimizers, self.schedulers, self.dataloader
        )
        self.nonfinite = NonFiniteGuard(job.training.get("nonfinite", "stop"),
                                        job.training.get("nonfinite_max_skips", 5),
                                        rank=self.rank, world=self.world, device=self.device)
        self.preemption = Preemption(job, self.device)
        flops = spec.load("flops")
        self.flops_per_token = (
            float(flops(model_config(job.model, spec), int(job.training.seq_len))[1]) if flops else 0.0
        )
        # metrics.peak_tflops, else the device's peak in the run's compute dtype (CPU: measured)
        self.peak_tflops = run_peak_tflops(job, self.device.type)
        self.peak_source = ("metrics.peak_tflops" if job.metrics.get("peak_tflops") else
                            "probed on this CPU" if self.device.type == "cpu" else "device data sheet")
        self.ft = None  # fault_tolerance=torchft: this rank's torchft Manager (train/replica_loop.py)
        if self.fault_tolerant:
            from titan_plugins.train.replica_loop import start_session

            self.ft = start_session(self)

    # ------------------------------------------- the objectives' view (objectives.job.JobView)
    @property
    def config(self) -> DictConfig:
        return self.job

    @property
    def fault_tolerant(self) -> bool:
        return bool(self.job.get("fault_tolerance") is not None and self.job.fault_tolerance.enable)

    def build_dataloader(self) -> DataLoader:
        from titan_plugins.data import build_dataloader, build_tokenizer

        data_cfg = self.job.data
        tokenizer = self.tokenizer = build_tokenizer(data_cfg)
        dp_rank, dp_world, accum = self.dims.dp_rank(), self.dims.dp_size, self.accum
        if self.fault_tolerant:  # every rank reads the whole global batch, trains its share of it
            dp_rank, dp_world = 0, 1
            accum = self.accum * self.dims.dp_size * int(self.job.fault_tolerance.replica_groups)
        return build_dataloader(
            data_cfg,
            tokenizer,
            dp_rank=dp_rank,
            dp_world=dp_world,
            local_batch_size=int(self.job.training.local_batch_size),
            seq_len=int(self.job.training.seq_len),
            seed=int(self.job.training.seed),
            datasets=self.pm.datasets(),
            grad_accum_steps=accum,  # the global batch's rows, the same at any layout
        )

    def loss_context(self) -> contextlib.AbstractContextManager[Any]:
        if self.loss_parallel:
            from torch.distributed.tensor.parallel import loss_parallel

            return loss_parallel()
        return contextlib.nullcontext()

    def validation_batches(self) -> Iterator[Any] | None:
        return iter(self.validator.loader()) if self.validator is not None else None

    def step_rng(self, step: int) -> torch.Generator:
        from titan_plugins.objectives.job import step_seed

        generator = torch.Generator(device=self.device)
        generator.manual_seed(step_seed(int(self.job.training.seed), self.rank, step))
        return generator

    # ------------------------------------------------------------------ step
    def train_step(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[float, float, float]:
        """One optimizer step; returns (global loss, grad norm, global count).

        The objective (``objective.name``) computes the loss of each microbatch as its
        share of the whole global batch's (every DP rank, every microbatch), so the loss
        is the same at any layout; ``self.step_metrics`` holds the objective's other
        metrics of the step (DPO's rewards/*, logps/*)."""
        loss_sum, sums, count = run_microbatches(self, batches, train=True)
        self.step_metrics = self.objective.metrics(sums, count) if sums else {}

        grad_norm = clip_grad_norm_(
            self.model.parameters(), float(self.job.training.max_norm), pp_group=self.pp_group
        )
        self.apply_update(getattr(self, "last_step", 0) + 1, loss_sum, grad_norm)

        if self.dp_group is not None:
            dist.all_reduce(loss_sum, group=self.dp_group)
        if self.pp_group is not None:
            dist.all_reduce(loss_sum, group=self.pp_group)  # only the last stage holds a loss
        return float(loss_sum.item()), float(grad_norm.item()), primary(count)

    def apply_update(self, step: int, loss_sum: torch.Tensor, grad_norm: torch.Tensor, *,
                     committed: bool = True) -> None:
        """Step ``step``'s optimizer and LR-schedule update (none of it when not
        ``committed``: torchft's replica loop), then clear the gradients."""
        if committed:
            # training.nonfinite: the ranks agree (one all-reduce) whether this update is dropped
            if not self.nonfinite.check(step, loss_sum, grad_norm):
                for opt in self.optimizers:
                    opt.step()
            for sched in self.schedulers:
                sched.step()
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)

    def data_counts(self) -> str | None:
        """What the training source counted (chat: conversations truncated, dropped, skipped),
        summed over the data-parallel ranks (a collective: every rank calls it)."""
        source = self.dataloader if hasattr(self.dataloader, "stats") else getattr(self.dataloader, "dataset", None)
        stats = source.stats() if hasattr(source, "stats") else {}  # a plain loader: its dataset's counts
        if not stats:
            return None
        keys = sorted(stats)
        counts = torch.tensor([stats[k] for k in keys], dtype=torch.float64, device=self.device)
        if self.dp_group is not None:
            dist.all_reduce(counts, group=self.dp_group)
        return ", ".join(f"{k.replace('_', ' ')} {int(v)}" for k, v in zip(keys, counts.tolist()))

    # ------------------------------------------------------------------ loop
    def train(self) -> dict[str, float]:
        job, pm, rank = self.job, self.pm, self.rank
        step = self.checkpointer.maybe_resume()
        report = RunReport(self, step)  # the header on rank 0; ETA and summary below
        profiler = StepProfiler(job, self.run_dir, rank, self.device.type, resumed_at=step)
        pm.hook.titan_on_train_start(job_config=job, run_dir=self.run_dir, rank=rank)
        self.last_step, self.last_metrics = step, {}
        try:
            step, metrics = self._loop(step, report, profiler)
        except BaseException as exc:
            # Sinks close their runs as failed (never masking the error itself).
            with contextlib.suppress(Exception):
                pm.hook.titan_on_train_error(step=self.last_step, error=f"{type(exc).__name__}: {exc}",
                                             metrics=self.last_metrics, job_config=job, rank=rank)
            raise
        profiler.close(step)
        pm.hook.titan_on_train_end(step=step, metrics=metrics, job_config=job, rank=rank)
        report.stats.data_counts = self.data_counts()
        report.stats.nonfinite = self.nonfinite.summary()
        if self.step_metrics:
            report.stats.objective = ", ".join(f"{k} {v:.4g}" for k, v in self.step_metrics.items())
        report.finish()
        if job.training.dump_final_params:
            self.dump_final_params()
        if job.checkpoint.get("export_hf"):
            from titan_plugins.export.full import export_run

            export_run(self.model.parts, pp_group=self.pp_group, rank=rank, spec=self.spec, job=job,
                       run_dir=self.run_dir)
        return metrics

    def _loop(self, step: int, report: RunReport, profiler: StepProfiler) -> tuple[int, dict[str, float]]:
        """Steps from ``step`` to ``training.steps``; returns the last step and its metrics."""
        if self.ft is not None:  # fault_tolerance=torchft: quorum, share, sum over groups, commit
            from titan_plugins.train.replica_loop import replica_loop

            return replica_loop(self, step, report, profiler)
        metrics: dict[str, float] = {}
        data = iter(self.dataloader)
        while step < self.steps:
            t0 = time.perf_counter()
            lr = float(self.schedulers[0].get_last_lr()[0])
            batches = [next(data) for _ in range(self.accum)]
            batches = self.objective.rollout(self, step + 1, batches)  # online objectives: sample and score
            loss, grad_norm, _trained = self.train_step(batches)
            step += 1
            tokens = sum(b[0].numel() for b in batches) * self.dims.dp_size
            metrics = self.end_step(step, tokens, time.perf_counter() - t0, lr, loss, grad_norm, report, profiler)
        return step, metrics

    def end_step(self, step: int, tokens: int, dt: float, lr: float, loss: float, grad_norm: float,
                 report: RunReport, profiler: StepProfiler, extra: dict[str, float] | None = None) -> dict[str, float]:
        """After step ``step`` (``tokens``: the global batch's): its metrics, the console
        line, the hooks, validation, the save and the preemption check."""
        job, pm, rank = self.job, self.pm, self.rank
        # Throughput counts every position the model computed (padding and masked
        # prompt tokens too, as FLOPs do), not only the tokens the loss counts.
        tps = tokens / dt
        tflops = self.flops_per_token * tps / self.world / 1e12
        metrics = {
            "loss": loss,
            "grad_norm": grad_norm,
            "lr": lr,
            "tokens_per_s": tps,
            "tflops": tflops,
            "memory_gib": memory_gib(self.device.type),
            "step_time_s": dt,
        }
        metrics.update(self.step_metrics)  # the objective's own (DPO: rewards/*, logps/*)
        metrics.update(extra or {})
        if self.peak_tflops:
            mfu = mfu_percent(tflops, self.peak_tflops)
            if mfu is not None:
                metrics["mfu"] = mfu
            else:  # the peak is not credible (a CPU probe taken under load): no MFU at all
                if rank == 0 and job.metrics.console:
                    print(f"MFU left out from step {step}: {tflops:.3g} TFLOP/s per rank exceeds the "
                          f"peak of {self.peak_tflops:.3g} ({self.peak_source}); set "
                          "metrics.peak_tflops to this machine's figure", flush=True)
                self.peak_tflops = None
        metrics["eta_s"] = report.step(step, metrics)
        self.last_step, self.last_metrics = step, metrics
        pm.hook.titan_on_step_end(step=step, metrics=metrics, job_config=job, rank=rank)
        profiler.step(step)
        if self.validator is not None and self.validator.due(step, self.steps):
            val = self.validator.run()
            report.validation(step, val)
            pm.hook.titan_on_validation_end(step=step, metrics=val, job_config=job, rank=rank)
        saved = self.checkpointer.save(step) if self.checkpointer.should_save(step, self.steps) else None
        sig = self.preemption.due()  # checkpoint.on_signal: the ranks agree, save and stop (exit 75)
        if sig is not None and step < self.steps:
            raise self.preemption.stop(sig, step, saved or self.checkpointer.save(step), rank)
        return metrics

    def dump_final_params(self) -> None:
        sd = full_model_state_dict(self.model.parts, self.pp_group)
        if self.rank == 0 and sd is not None:
            path = Path(self.run_dir) / "final_params.pt"
            torch.save(sd, path.with_suffix(".tmp"))
            os.replace(path.with_suffix(".tmp"), path)
        dist.barrier()
