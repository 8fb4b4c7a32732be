"""The reference model of objectives that need one (DPO): the policy's forward as it
was before training, under ``torch.no_grad``.

- ``peft=lora``: the same model with its adapters off (every adapter's scaling 0 for
  the forward: ``out + 0``, bitwise the base), so no second copy of the weights.
- Full fine-tuning: a frozen copy built and sharded exactly like the policy (the same
  lifecycle, so FSDP/TP place it the same way) holding the policy's starting weights.
- ``objective.precompute_ref=true``: no model at all during training; the policy's
  per-row values at its starting weights, computed in a first pass over the data (and
  the validation rows) before step 1 and stored in the run directory
  (``precompute.py``), are read back by each row's key.

MoE token counters the forward adds to are put back, and FSDP units resharded after
(validation.py's helpers), so a reference pass changes nothing the policy's step reads.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from titan_plugins.errors import ConfigError
from titan_plugins.peft.lora import adapter_modules, lora_enabled

if TYPE_CHECKING:
    from titan_plugins.model.lifecycle import ModelParts
    from titan_plugins.objectives.job import JobView

__all__ = ["PrecomputedReference", "Reference", "adapters_off", "build_reference"]


@contextlib.contextmanager
def adapters_off(parts: list[nn.Module]) -> Iterator[int]:
    """Every LoRA adapter of ``parts`` contributes nothing inside the block; yields how
    many were switched off."""
    saved = [(m, m.scaling) for part in parts for _, m in adapter_modules(part)]
    try:
        for m, _ in saved:
            m.scaling = 0.0
        yield len(saved)
    finally:
        for m, scaling in saved:
            m.scaling = scaling


class Reference:
    """``reference(inputs) -> output`` of the reference policy (no grad)."""

    def __init__(self, policy: ModelParts, frozen: ModelParts | None) -> None:
        self.policy, self.frozen = policy, frozen
        self.kind = "the base model (LoRA adapters off, no second copy)" if frozen is None else \
            "a frozen copy of the starting weights, sharded like the policy"

    @torch.no_grad()
    def __call__(self, inputs: torch.Tensor, reduce: Callable[[Any], Any] = lambda out: out,
                 labels: torch.Tensor | None = None) -> Any:
        """``reduce(output)`` of the reference's forward, computed inside the forward's
        contexts: the output may be the last hidden state with a reference to the head
        (loss/token_loss.py computes logits chunk by chunk), so the head's weights must still
        be gathered (FSDP) and the adapters still off when the loss reads it."""
        from titan_plugins.distributed.forward_only import moe_counters_kept, resharded

        if self.frozen is not None:
            with resharded(self.frozen.parts):
                return reduce(self.frozen.parts[0](inputs))
        parts = self.policy.parts
        with adapters_off(parts), moe_counters_kept(parts), resharded(parts):
            return reduce(parts[0](inputs))


class PrecomputedReference:
    """``reference(inputs, reduce, labels)``: the stored values of the batch's rows."""

    def __init__(self, store: Any, device: torch.device, rows: int) -> None:
        self.store, self.device = store, device
        how = "precomputed in a first pass over" if store.computed else "read from the first pass over"
        self.kind = (f"the starting weights' log-probs, {how} {rows} rows, no model copy "
                     f"(objective.precompute_ref: {store.path.name} in the run directory)")

    def __call__(self, inputs: torch.Tensor, reduce: Callable[[Any], Any] = lambda out: out,
                 labels: torch.Tensor | None = None) -> torch.Tensor:
        assert labels is not None, "a stored reference is looked up by the rows' tokens and labels"
        return self.store.lookup(inputs, labels, self.device)


def _epoch_batches(run: JobView, loader: Any) -> int:
    """Microbatches per rank that cover every pair of the source once (its first epoch)."""
    dataset = getattr(loader, "dataset", None)
    try:
        pairs = len(dataset)  # type: ignore[arg-type]
    except TypeError:
        raise ConfigError(f"objective.precompute_ref=true needs a data source of known length (data.name="
                          f"{run.config.data.name} streams); use data=preference") from None
    per_step = int(run.config.training.local_batch_size) // 2 * run.dims.dp_size * run.accum
    return -(-pairs // per_step) * run.accum


def _store_meta(job: Any) -> dict[str, Any]:
    """What the stored values depend on: the starting weights and the rows."""
    from omegaconf import OmegaConf

    def plain(node: Any) -> Any:
        return OmegaConf.to_container(node, resolve=True) if node is not None else None

    # A random start (no checkpoint.init_from, no model.hf) differs from layout to layout.
    random_start = not job.checkpoint.get("init_from") and not job.model.get("hf")
    meta = {"model": plain(job.model), "init_from": job.checkpoint.get("init_from"), "peft": plain(job.get("peft")),
            "layout": plain(job.parallelism) if random_start else None,
            "seed": int(job.training.seed), "data": plain(job.data), "seq_len": int(job.training.seq_len),
            "validation": ({k: v for k, v in plain(job.validation).items() if k != "every"}
                           if job.validation.enabled else None),
            "objective": str(job.objective.name)}
    return json.loads(json.dumps(meta, default=str))  # plain values (enums as text): a weights-only load reads them


def precomputed_reference(run: JobView) -> PrecomputedReference:
    """Read the run directory's store, or run the first pass (every rank, the training
    loader's first epoch and the validation batches, the policy at its starting
    weights as the reference) and write it."""
    from pathlib import Path

    from titan_plugins.objectives.precompute import STORE, ReferenceStore, first_pass, on_every_rank

    config, objective = run.config, run.objective
    path = Path(run.run_dir) / STORE
    meta = _store_meta(config)
    if on_every_rank(path):
        store = ReferenceStore.load(path, meta)
        return PrecomputedReference(store, run.device, len(store.values))
    policy = Reference(run.model, None)  # the starting weights (adapters off under LoRA)

    def values_of(inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        inputs, labels = inputs.to(run.device), labels.to(run.device)
        with run.loss_context():  # as the train step calls the reference (step.py)
            return policy(inputs, lambda out: objective.reference_stats(out, labels))

    def batches() -> Any:
        # A second loader built as the trainer builds its own (same rows, same microbatches).
        loader = run.build_dataloader()
        for _ in range(_epoch_batches(run, loader)):
            yield next(loader)[:2]
        rows = run.validation_batches()  # the validator's batches: a fresh loader, the same rows each time
        if rows is not None:
            for _ in range(int(config.validation.steps)):
                yield next(rows)[:2]

    store = ReferenceStore(path, ReferenceStore.gather(first_pass(batches(), values_of)), computed=True)
    if run.rank == 0:
        store.save(meta)
    return PrecomputedReference(store, run.device, len(store.values))


def build_reference(run: JobView) -> Reference | PrecomputedReference:
    """The reference of the running policy (``run.model``): call after the policy's weights are loaded
    (before a checkpoint's: resuming happens after, so these are the starting weights)."""
    if run.config.objective.get("precompute_ref"):
        return precomputed_reference(run)
    if lora_enabled(run.config):
        return Reference(run.model, None)
    from titan_plugins.model.lifecycle import build_model_parts

    frozen = build_model_parts(run.spec, run.config, run.dims, run.device, run.pm, None)
    with torch.no_grad():
        for ref_part, part in zip(frozen.parts, run.model.parts, strict=True):
            mine = dict(part.named_parameters())
            for name, param in ref_part.named_parameters():
                param.copy_(mine[name].detach())  # DTensor to DTensor: same placements
                param.requires_grad_(False)
    return Reference(run.model, frozen)
