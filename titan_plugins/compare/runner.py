"""Run one side of a comparison through the runtime and record its curve.

Both sides start from one seed checkpoint (made once, on one rank), or from the
weights of ``model.hf`` where the baseline loads a Hugging Face folder, run
deterministic with the same seed, and see the same global batch: when the two
sides have different data-parallel degrees, the test side's per-rank batch is
scaled so that local_batch_size x dp x grad_accum_steps matches the baseline.
"""

from __future__ import annotations

import contextlib
import json
import shlex
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from titan_plugins.compare.curves import Curve
from titan_plugins.errors import ConfigError

DETERMINISTIC = ["training.deterministic=true"]


def split_overrides(text: str) -> list[str]:
    return shlex.split(text)


@dataclass
class BatchShape:
    local_batch_size: int
    dp: int
    grad_accum_steps: int

    @property
    def global_batch(self) -> int:
        return self.local_batch_size * self.dp * self.grad_accum_steps


def batch_shape(overrides: list[str]) -> BatchShape:
    """Compose one side's config (no rank starts) to learn its global batch."""
    from titan_plugins.config.hydra_glue import compose
    from titan_plugins.distributed.parallel_dims import ParallelDims
    from titan_plugins.plugins import get_plugin_manager

    cfg = compose(overrides, get_plugin_manager(strict=True))
    dims = ParallelDims.from_config(cfg.parallelism)
    return BatchShape(cfg.training.local_batch_size, dims.dp_size, cfg.training.grad_accum_steps)


def match_global_batch(baseline: list[str], test: list[str]) -> tuple[list[str], str | None]:
    """Return the test overrides adjusted to the baseline's global batch, and a note."""
    b, t = batch_shape(baseline), batch_shape(test)
    if b.global_batch == t.global_batch:
        return test, None
    per_rank = t.dp * t.grad_accum_steps
    if b.global_batch % per_rank:
        raise ConfigError(
            f"cannot match the global batch: baseline has {b.global_batch} sequences per step, "
            f"which does not divide over the test side's dp x grad_accum_steps = {per_rank}"
        )
    local = b.global_batch // per_rank
    note = (
        f"note: test side uses training.local_batch_size={local} so that its global batch "
        f"equals the baseline's {b.global_batch} sequences"
    )
    return [*test, f"training.local_batch_size={local}"], note


def hf_folder(overrides: list[str]) -> str | None:
    """The side's ``model.hf`` folder (composed, so a YAML default counts too), if any."""
    from titan_plugins.config.hydra_glue import compose
    from titan_plugins.plugins import get_plugin_manager

    cfg = compose(overrides, get_plugin_manager(strict=True))
    return cfg.model.get("hf") or None


def say(text: str) -> None:
    """Progress, on stderr: stdout carries the report alone."""
    print(f"titan-compare: {text}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def progress(label: str, run_dir: Path, steps: int | None, every: float = 1.0) -> Iterator[None]:
    """Say each step of the run writing ``run_dir`` as its ``metrics.jsonl`` grows."""
    path = run_dir / "metrics.jsonl"
    start = path.stat().st_size if path.is_file() else 0  # a reused workdir: only new records
    state = {"offset": start}
    total = f"/{steps}" if steps else ""

    def poll() -> None:
        if not path.is_file():
            return
        with open(path) as f:
            f.seek(state["offset"])
            for line in f:
                if not line.endswith("\n"):
                    break  # a record still being written
                state["offset"] += len(line.encode())
                rec = json.loads(line) if line.strip() else {}
                if "step" in rec and "loss" in rec:
                    say(f"{label}: step {rec['step']}{total}, loss {rec['loss']:.4f}")

    stop = threading.Event()

    def watch() -> None:
        while not stop.wait(every):
            with contextlib.suppress(OSError, ValueError):
                poll()

    thread = threading.Thread(target=watch, daemon=True)
    t0 = time.perf_counter()
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
        with contextlib.suppress(OSError, ValueError):
            poll()
        say(f"{label}: finished in {time.perf_counter() - t0:.0f} s")


def make_seed_checkpoint(overrides: list[str], workdir: Path) -> Path:
    """Initialise the model once on one rank and save its weights (DCP)."""
    from titan_plugins.train.api import run

    run_dir = workdir / "seed"
    say("seed: initialising the model once on one rank")
    result = run([*overrides, "parallelism=single", "checkpoint.create_seed=true"], run_dir=run_dir)
    if result.returncode != 0:
        raise RuntimeError(f"creating the seed checkpoint failed: {result.error}")
    return seed_checkpoint_path(run_dir, overrides)


def seed_checkpoint_path(run_dir: Path, overrides: list[str]) -> Path:
    """Where the worker writes the seed: ``<run_dir>/<checkpoint.folder>/seed``."""
    folder = next(
        (o.split("=", 1)[1] for o in reversed(overrides) if o.startswith("checkpoint.folder=")),
        "checkpoints",
    )
    path = Path(folder)
    return (path if path.is_absolute() else run_dir / path) / "seed"


def run_side(label: str, overrides: list[str], workdir: Path, *, with_params: bool,
             steps: int | None = None, describe: str = "") -> Curve:
    from titan_plugins.train.api import run

    extra = ["training.dump_final_params=true"] if with_params else []
    run_dir = workdir / label
    say(f"{label}: starting {describe}".rstrip() + f" (run directory {run_dir})")
    with progress(label, run_dir, steps):
        result = run([*overrides, *extra], run_dir=run_dir)
    if result.returncode != 0:
        raise RuntimeError(f"the {label} run failed: {result.error}")
    params = run_dir / "final_params.pt"
    return Curve(
        label=" ".join(overrides),
        overrides=list(overrides),
        losses=list(result.losses),
        grad_norms=list(result.grad_norms),
        params_file=str(params) if with_params and params.exists() else None,
    )
