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

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from titan_plugins.distributed.forward_only import moe_counters_kept, resharded
from titan_plugins.errors import ConfigError

if TYPE_CHECKING:
    from omegaconf import DictConfig

__all__ = ["Validator", "moe_counters_kept", "resharded", "validation_data_config"]

# Sources that are one file or folder with no notion of a split: the held-out rows
# need their own validation.path.
_NO_SPLIT = ("text", "jsonl", "parquet", "mix", "chat", "preference")


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


class Validator:
    """Scores ``validation.steps`` batches of held-out rows; called by the trainer."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        self.data_config = validation_data_config(trainer.job)
        self.steps = int(trainer.job.validation.steps)
        self.every = int(trainer.job.validation.every)

    def due(self, step: int, last_step: int) -> bool:
        return step % self.every == 0 or step == last_step

    def loader(self) -> Any:
        t = self.trainer
        from titan_plugins.data import build_dataloader, build_tokenizer

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
        """The objective's held-out record over the batches, on every rank (SFT:
        ``{"loss", "perplexity", "tokens"}``): each batch's mean loss weighted by its
        count (tokens, pairs), through the train step's own microbatch loop."""
        from titan_plugins.objectives.step import add_counts, primary, run_microbatches

        t = self.trainer
        model = t.model
        loss_sum = torch.zeros((), dtype=torch.float64, device=t.device)
        count_sum: Any = None
        sums: dict[str, float] = {}
        rows = iter(self.loader())
        with moe_counters_kept(model.parts), resharded(model.parts):
            for _ in range(self.steps):
                batch_loss, batch_sums, count = run_microbatches(t, [next(rows)], train=False,
                                                                 acc_dtype=torch.float64)
                count_sum = add_counts(count_sum, count)
                loss_sum += batch_loss * primary(count)  # the batch's mean loss, weighted by its count
                for key, value in batch_sums.items():
                    sums[key] = sums.get(key, 0.0) + value
        t.objective.set_scale(1.0)  # the next train step sets its own
        if t.dp_group is not None:
            dist.all_reduce(loss_sum, group=t.dp_group)
        if t.pp_group is not None:
            dist.all_reduce(loss_sum, group=t.pp_group)  # only the last stage holds a loss
        return t.objective.validation_metrics(float(loss_sum.item()) / primary(count_sum), sums, count_sum)
