"""Validation during training: the loss on held-out rows, every ``validation.every`` steps.

Forward only, under ``torch.no_grad``: no gradient, no optimizer step, no scheduler
step. The rows come from a loader of their own, rebuilt for every validation so each
one scores the same rows; the training loader's position is never touched. MoE
token counters (``tokens_per_expert``, which the load-balancing hook reads before the
next optimizer step) are saved and restored, so a run with validation trains
bitwise like one without. Under PP the schedule's ``eval`` runs forward only and the
last stage computes the loss, as in training.
"""

from __future__ import annotations

import contextlib
import math
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from titan_plugins.components.attention_masks import documents
from titan_plugins.errors import ConfigError
from titan_plugins.train.loss import count_tokens

if TYPE_CHECKING:
    from omegaconf import DictConfig

__all__ = ["Validator", "validation_data_config"]

# Sources that are one file or folder with no notion of a split: the held-out rows
# need their own validation.path.
_NO_SPLIT = ("text", "jsonl", "parquet", "mix", "chat")


def validation_data_config(job: DictConfig) -> Any:
    """The data config of the held-out rows: the training data with ``validation.split``,
    or ``validation.name`` / ``validation.path`` where given. Raises ConfigError in one line."""
    val = job.validation
    data = OmegaConf.to_container(job.data, resolve=True)
    if val.name:
        data["name"] = val.name
    if val.path:
        data["path"] = val.path
    data["split"] = val.split
    if data["name"] in _NO_SPLIT and not val.path:
        raise ConfigError(
            f"validation.path is needed with data.name={data['name']} (such a source has no held-out "
            f"split; give the held-out file as validation.path)"
        )
    if val.path and data["name"] in _NO_SPLIT and val.path == job.data.path:
        raise ConfigError(f"validation.path={val.path} is the training data.path: the rows would not be held out")
    return OmegaConf.create(data)


def check_validation(job: DictConfig) -> None:
    """Before launch: the numbers and the data source of the validation group."""
    val = job.validation
    if not val.enabled:
        return
    for key in ("every", "steps"):
        if int(val[key]) < 1:
            raise ConfigError(f"validation.{key}={val[key]} must be at least 1")
    validation_data_config(job)


@contextlib.contextmanager
def _resharded(parts: list[torch.nn.Module]):
    """Reshard every FSDP unit after the forward passes. FSDP2 keeps the units that do not
    reshard after forward (the last block, the head, every unit under PP) unsharded until
    their backward, which a forward-only pass never runs: the modules would keep the
    unsharded parameters registered, not the sharded ones the optimizer holds, and the
    next checkpoint's optimizer state could not name them (``KeyError`` in
    ``get_optimizer_state_dict``)."""
    try:
        yield
    finally:
        from torch.distributed.fsdp import FSDPModule

        for part in parts:
            for module in part.modules():
                if isinstance(module, FSDPModule):
                    module.reshard()


@contextlib.contextmanager
def _moe_counters_kept(parts: list[torch.nn.Module]):
    """Forward passes add to every MoE's ``tokens_per_expert``; put them back after."""
    saved = [(buf, buf.detach().clone()) for part in parts
             for name, buf in part.named_buffers() if name.endswith("tokens_per_expert")]
    try:
        yield
    finally:
        with torch.no_grad():
            for buf, value in saved:
                buf.copy_(value)


class Validator:
    """Scores ``validation.steps`` batches of held-out rows; called by the trainer."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        self.data_config = validation_data_config(trainer.job)
        self.steps = int(trainer.job.validation.steps)
        self.every = int(trainer.job.validation.every)

    def due(self, step: int, last_step: int) -> bool:
        return step % self.every == 0 or step == last_step

    def _loader(self) -> Any:
        t = self.trainer
        from titan_plugins.train.data import build_dataloader, build_tokenizer

        data = self.data_config
        return build_dataloader(
            data, build_tokenizer(data),
            dp_rank=t.dims.dp_rank(), dp_world=t.dims.dp_size,
            local_batch_size=int(t.job.training.local_batch_size),
            seq_len=int(t.job.training.seq_len), seed=int(t.job.training.seed),
            datasets=t.pm.datasets(),
        )  # fmt: skip

    @torch.no_grad()
    def run(self) -> dict[str, float]:
        """``{"loss", "perplexity", "tokens"}`` over the held-out batches, on every rank."""
        t = self.trainer
        model = t.model
        loss_fn = t.loss_fn
        saved_tokens = loss_fn.global_tokens
        loss_sum = torch.zeros((), dtype=torch.float64, device=t.device)
        tokens_sum = 0.0
        rows = iter(self._loader())
        with _moe_counters_kept(model.parts), _resharded(model.parts):
            for _ in range(self.steps):
                batch = next(rows)
                inputs, labels = batch[0].to(t.device), batch[1].to(t.device)
                doc_ids = getattr(batch, "doc_ids", None)  # packed conversations
                docs = documents(None if doc_ids is None else doc_ids.to(t.device))
                tokens = count_tokens(labels).to(torch.float64).to(t.device)
                if t.dp_group is not None:
                    dist.all_reduce(tokens, group=t.dp_group)
                loss_fn.global_tokens = float(tokens.item())
                tokens_sum += loss_fn.global_tokens
                batch_loss = torch.zeros((), dtype=torch.float64, device=t.device)
                with t._loss_context(), docs:
                    if model.pp:
                        from titan_plugins.distributed.pipeline import stage_inputs

                        losses: list[torch.Tensor] = []
                        extra = stage_inputs(model.parts[0], t.spec.pipeline, inputs)
                        args = (inputs,) if model.has_first else ()
                        model.schedule.eval(*args, target=labels, losses=losses, **extra)
                        for mb_loss in losses:
                            batch_loss += _local(mb_loss).double()
                    else:
                        batch_loss += _local(loss_fn(model.parts[0](inputs), labels)).double()
                # the batch's mean loss, weighted by its tokens
                loss_sum += batch_loss * loss_fn.global_tokens
        loss_fn.global_tokens = saved_tokens
        if t.dp_group is not None:
            dist.all_reduce(loss_sum, group=t.dp_group)
        if t.pp_group is not None:
            dist.all_reduce(loss_sum, group=t.pp_group)  # only the last stage holds a loss
        loss = float(loss_sum.item()) / tokens_sum
        return {"loss": loss, "perplexity": math.exp(min(loss, 700.0)), "tokens": tokens_sum}


def _local(x: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return (x.full_tensor() if isinstance(x, DTensor) else x).detach()
