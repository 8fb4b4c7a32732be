"""A test plugin that parks every rank after a chosen step (``TITAN_TEST_PARK_AFTER=N``),
inside GRPO's generation or update of one (``TITAN_TEST_PARK_IN_ROLLOUT`` / ``_IN_UPDATE``),
inside the save of a chosen step (``TITAN_TEST_PARK_IN_SAVE=N``) or inside the native
rollout engine's generation of a chosen step (``TITAN_TEST_PARK_IN_ROLLOUT=N``), so that
a test can send a real signal to a real rank process mid-run, mid-save or mid-generation,
and poisons one rank's last hidden states with NaN at chosen steps (``TITAN_TEST_NAN``)."""

from __future__ import annotations

import os
import time
from typing import Any

from titan_plugins.hookspecs import hookimpl

TITAN_PLUGINS_API = ">=1.0,<2"


def _park(run_dir: str, rank: int) -> None:
    path = os.path.join(run_dir, f"parked-{rank}")
    with open(f"{path}.tmp", "w") as f:
        f.write(str(os.getpid()))
    os.replace(f"{path}.tmp", path)  # the pid, for the test's signal
    from titan_plugins.distributed.rank_signals import preemption_requested

    deadline = time.monotonic() + 120  # the test kills a rank; the launcher stops this one
    while time.monotonic() < deadline and preemption_requested() is None:
        time.sleep(0.05)  # a preemption signal ends the wait: the trainer saves and stops


@hookimpl
def titan_on_step_end(step: int, metrics: dict[str, float], job_config: Any, rank: int) -> None:
    park = int(os.environ.get("TITAN_TEST_PARK_AFTER", "0"))
    if park and step == park:
        _park(str(job_config.run_dir), rank)


@hookimpl
def titan_on_train_start(job_config: Any, run_dir: str, rank: int) -> None:
    """``TITAN_TEST_PARK_IN_SAVE=N``: every rank parks inside the save of ``step-N``, once
    DCP has written all of it to ``step-N.tmp`` (shards and ``.metadata``) and before the
    manifest and the rename: the most complete a save gets without being complete."""
    in_rollout = int(os.environ.get("TITAN_TEST_PARK_IN_ROLLOUT", "0"))
    if in_rollout:
        _park_in_rollout(in_rollout, run_dir, rank)
    in_update = int(os.environ.get("TITAN_TEST_PARK_IN_UPDATE", "0"))
    if in_update:
        _park_in_update(in_update, run_dir, rank)
    park = int(os.environ.get("TITAN_TEST_PARK_IN_SAVE", "0"))
    if not park:
        return
    from titan_plugins.checkpoint import checkpointer as checkpoint

    real = checkpoint.dcp

    class _Parking:  # the checkpoint module's ``dcp``, parking after one save
        def __getattr__(self, name: str) -> Any:
            return getattr(real, name)

        def save(self, *args: Any, checkpoint_id: str, **kwargs: Any) -> Any:
            out = real.save(*args, checkpoint_id=checkpoint_id, **kwargs)
            if os.path.basename(checkpoint_id) == f"step-{park}.tmp":
                _park(run_dir, rank)
            return out

    checkpoint.dcp = _Parking()


def _park_in_rollout(park: int, run_dir: str, rank: int) -> None:
    """``TITAN_TEST_PARK_IN_ROLLOUT=N``: every rank parks inside ``rollout=native``'s
    generation of step N, once the prompts' forward has filled the KV cache (with FSDP's
    weights gathered) and before the first completion token is sampled: the engine's
    ``complete`` notes the step, its module's ``last_logits`` (called once per decoding
    forward) parks on the first forward of that step."""
    from titan_plugins.objectives import rollout_native as native

    real_complete, real_logits = native.NativeRollout.complete, native.last_logits
    now = {"step": 0, "forwards": 0}

    def complete(self: Any, run: Any, step: int, *args: Any, **kwargs: Any) -> Any:
        now["step"], now["forwards"] = step, 0
        return real_complete(self, run, step, *args, **kwargs)

    def last_logits(*args: Any, **kwargs: Any) -> Any:
        out = real_logits(*args, **kwargs)
        now["forwards"] += 1
        if now["step"] == park and now["forwards"] == 1:
            _park(run_dir, rank)
        return out

    native.NativeRollout.complete = complete
    native.last_logits = last_logits


def _park_in_update(park: int, run_dir: str, rank: int) -> None:
    """``TITAN_TEST_PARK_IN_UPDATE=N`` (``rollout=native``): every rank parks at step N's
    optimizer step, its rollout sampled and scored, its backward done (the gradients
    reduced), the weights not yet updated: the engine's ``complete`` notes the step, a
    global optimizer pre-step hook parks."""
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    from titan_plugins.objectives import rollout_native as native

    real_complete = native.NativeRollout.complete
    now = {"step": 0}

    def complete(self: Any, run: Any, step: int, *args: Any, **kwargs: Any) -> Any:
        now["step"] = step
        return real_complete(self, run, step, *args, **kwargs)

    def before_step(*_: Any) -> None:
        if now["step"] == park:
            _park(run_dir, rank)

    native.NativeRollout.complete = complete
    register_optimizer_step_pre_hook(before_step)


@hookimpl
def titan_after_parallelize(model: Any, parallel_dims: Any, job_config: Any) -> None:
    """``TITAN_TEST_NAN=STEPS:RANK`` (``3,4:1``): that rank's hidden states become NaN in the
    forward of those steps (counted as forward calls: one microbatch, no validation)."""
    spec = os.environ.get("TITAN_TEST_NAN")
    if not spec:
        return None
    steps, rank = spec.split(":")
    bad = {int(s) for s in steps.split(",")}
    calls = [0]

    def poison(_module: Any, _inputs: Any, output: Any) -> Any:
        import torch.distributed as dist

        calls[0] += 1
        if calls[0] in bad and dist.get_rank() == int(rank):
            return output * float("nan")
        return None

    # The final norm's output (the head may be fused with the loss and run without hooks).
    target = getattr(model, "norm", None) or model
    target.register_forward_hook(poison)
    return None  # the core's own implementation still runs
