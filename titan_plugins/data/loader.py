"""The training data loader: batches of a registered dataset's token stream.

``build_dataloader`` looks ``data.name`` up among the registered datasets, calls
its builder and stacks ``local_batch_size`` samples per batch. The loader is an
infinite iterator of ``(input_ids, labels)`` int64 tensors ``[batch, seq_len]``
(a ``Batch``, which may also carry ``doc_ids``)
with ``state_dict()`` / ``load_state_dict()`` (the dataset's own state: the
loader holds no samples between batches, so nothing is lost on resume).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch

from titan_plugins.data.batch import Batch
from titan_plugins.errors import ConfigError
from titan_plugins.spec import DatasetSpec, resolve
from titan_plugins.suggest import did_you_mean


def find_dataset(name: str, datasets: Mapping[str, DatasetSpec]) -> DatasetSpec:
    """The spec registered as ``name``; a ConfigError with a suggestion if none is."""
    if name in datasets:
        return datasets[name]
    raise ConfigError(
        f"data.name={name!r} is not a registered dataset{did_you_mean(name, datasets)} "
        f"(choose from: {', '.join(sorted(datasets)) or 'none'})"
    )


class DataLoader:
    """Stacks ``local_batch_size`` samples of ``dataset`` into each batch."""

    def __init__(
        self, dataset: Any, *, local_batch_size: int, seq_len: int, name: str = ""
    ) -> None:
        self.dataset = dataset
        self.local_batch_size = local_batch_size
        self.seq_len = seq_len
        self.name = name
        # Deal samples to ranks in blocks of one batch (see packing.ShardedStream).
        if hasattr(dataset, "block"):
            dataset.block = local_batch_size
        self._samples: Iterator[tuple[torch.Tensor, torch.Tensor]] = iter(dataset)

    def __iter__(self) -> DataLoader:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        pairs = [next(self._samples) for _ in range(self.local_batch_size)]
        inputs = torch.stack([p[0] for p in pairs]).long()
        labels = torch.stack([p[1] for p in pairs]).long()
        expected = (self.local_batch_size, self.seq_len)
        if inputs.shape != expected or labels.shape != expected:
            # A dataset plugin's bug, not the user's: say which dataset.
            raise RuntimeError(
                f"dataset {self.name!r} yielded batches of shape {tuple(inputs.shape)}/"
                f"{tuple(labels.shape)}, expected {expected}"
            )
        docs = torch.stack([p[2] for p in pairs]).long() if len(pairs[0]) > 2 else None
        batch = Batch(inputs, labels, docs)
        if hasattr(pairs[0], "row"):  # a source's per-row payload (data.name=prompts)
            batch.rows = [p.row for p in pairs]
        return batch

    def state_dict(self) -> dict[str, Any]:
        return {"dataset": self.dataset.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.dataset.load_state_dict(state["dataset"])
        self._samples = iter(self.dataset)


def build_dataloader(
    data_config: Any,
    tokenizer: Any,
    *,
    dp_rank: int,
    dp_world: int,
    local_batch_size: int,
    seq_len: int,
    seed: int,
    datasets: Mapping[str, DatasetSpec],
    grad_accum_steps: int = 1,
) -> DataLoader:
    """This data-parallel rank's loader for ``data_config.name``.

    ``datasets`` is the registry (name -> DatasetSpec) the plugin manager collected.
    ``grad_accum_steps`` with ``dp_world`` and ``local_batch_size`` gives the rows of
    the global batch, which streaming sources deal out so that the layout does not
    change them.
    """
    if local_batch_size < 1:
        raise ConfigError(f"training.local_batch_size={local_batch_size} must be at least 1")
    spec = find_dataset(data_config.name, datasets)
    build = resolve(spec.build)
    dataset = build(
        data_config, tokenizer, dp_rank=dp_rank, dp_world=dp_world, seq_len=seq_len, seed=seed
    )
    if hasattr(dataset, "set_layout"):  # streaming: one stream per row of the global batch
        dataset.set_layout(local_batch_size, grad_accum_steps)
    if isinstance(dataset, torch.utils.data.IterableDataset):  # streaming: torchdata workers
        from titan_plugins.data.stateful_loader import StreamingLoader

        workers = int(getattr(data_config, "num_workers", 0) or 0)
        prefetch = int(getattr(data_config, "prefetch_factor", 2) or 2)
        if workers < 0 or prefetch < 1:
            raise ConfigError(f"data.num_workers={workers} must be >= 0 and data.prefetch_factor={prefetch} >= 1")
        return StreamingLoader(dataset, local_batch_size=local_batch_size, seq_len=seq_len,
                               num_workers=workers, prefetch_factor=prefetch, name=spec.name)
    return DataLoader(dataset, local_batch_size=local_batch_size, seq_len=seq_len, name=spec.name)
