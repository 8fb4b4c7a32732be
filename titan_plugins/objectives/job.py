"""The seam between an objective and the running job: :class:`JobView`.

Everything an objective's machinery (the microbatch loop in ``step.py``, the reference
in ``reference.py``, and the coming rollout stages) may touch of the job is named here,
typed, and public. The trainer implements it (``titan_plugins.train.trainer.Trainer``);
tests and third-party objectives can implement it with a small object of their own.
Nothing outside the trainer reaches into the trainer's private attributes.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch
    from omegaconf import DictConfig
    from torch.distributed import ProcessGroup

    from titan_plugins.distributed.parallel_dims import ParallelDims
    from titan_plugins.model.lifecycle import ModelParts
    from titan_plugins.objectives.base import Objective
    from titan_plugins.objectives.reference import PrecomputedReference, Reference
    from titan_plugins.plugins import TitanPluginManager
    from titan_plugins.spec import ModelSpec

__all__ = ["JobView", "step_seed"]


@runtime_checkable
class JobView(Protocol):
    """What an objective sees of the job it trains in.

    Attributes: ``job`` the resolved config (OmegaConf), ``spec`` the model's spec,
    ``pm`` the plugin manager (to build a frozen copy of the model), ``dims`` the
    parallel layout, ``model`` this rank's model parts (the live policy), ``objective``
    the objective itself, ``reference`` the reference model or stored log-probs
    (``None`` where the objective needs none), ``device``, ``rank`` (global),
    ``accum`` (microbatches per optimizer step), ``run_dir``, ``dp_group`` (the
    data-parallel process group, ``None`` without DP).
    """

    job: DictConfig
    spec: ModelSpec
    pm: TitanPluginManager
    dims: ParallelDims
    model: ModelParts
    objective: Objective
    reference: Reference | PrecomputedReference | None
    device: torch.device
    rank: int
    accum: int
    run_dir: str
    dp_group: ProcessGroup | None

    def loss_context(self) -> AbstractContextManager[Any]:
        """The context every loss (and every reference forward) runs under: TP's
        ``loss_parallel`` where the layout shards the vocabulary, else nothing."""
        ...

    def build_dataloader(self) -> Iterator[Any]:
        """A fresh loader over the training rows, built as the run's own (same rows,
        same microbatches, from the start): a first pass over the data reads it."""
        ...

    def validation_batches(self) -> Iterator[Any] | None:
        """The held-out batches, from their start (``None`` without validation)."""
        ...

    def step_rng(self, step: int) -> torch.Generator:
        """A generator seeded by ``(training.seed, rank, step)`` alone, so that whatever
        an objective samples at a step (rollouts) is the same after a resume."""
        ...


def step_seed(seed: int, rank: int, step: int) -> int:
    """A 63-bit seed of ``(seed, rank, step)``: nearby triples give unrelated streams."""
    import hashlib

    digest = hashlib.blake2b(f"{seed}:{rank}:{step}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)
