"""The loader of streaming datasets: torchdata's ``StatefulDataLoader`` runs the rank's
rows in worker processes with prefetch and keeps each worker's state with the
batches it hands out, so the state resumes bitwise (``StreamingLoader``).
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from titan_plugins.data.batch import Batch
from titan_plugins.data.rows import check_identity
from titan_plugins.errors import ConfigError


class StreamingLoader:
    """``(input_ids, labels)`` batches from a StatefulDataLoader over ``dataset``;
    ``state_dict``/``load_state_dict`` hold every worker's exact position."""

    def __init__(self, dataset: Any, *, local_batch_size: int, seq_len: int, num_workers: int,
                 prefetch_factor: int, name: str = "") -> None:
        self.dataset, self.local_batch_size, self.seq_len, self.name = dataset, local_batch_size, seq_len, name
        self.num_workers, self.prefetch_factor = num_workers, prefetch_factor
        if num_workers > 0:
            os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # one thread per worker
        self._loader = self._make()
        self._it: Iterator[Any] | None = None

    def _make(self) -> Any:
        from torchdata.stateful_dataloader import StatefulDataLoader

        extra = {"prefetch_factor": self.prefetch_factor} if self.num_workers > 0 else {}
        with warnings.catch_warnings():  # torchdata 0.11 calls a deprecated torch.set_vital
            warnings.filterwarnings("ignore", message=".*set_vital.*")
            return StatefulDataLoader(self.dataset, batch_size=self.local_batch_size,
                                      num_workers=self.num_workers, **extra)

    def __iter__(self) -> StreamingLoader:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._it is None:
            self._it = iter(self._loader)
        try:
            batch = next(self._it)
        except Exception as exc:  # a worker's ConfigError comes back wrapped: one line
            text = str(exc)
            if "ConfigError" in text or isinstance(exc, ConfigError):
                line = [ln for ln in text.splitlines() if ln.strip()][-1]
                raise ConfigError(line.split("ConfigError: ", 1)[-1]) from None
            raise
        return Batch(*(t.long() for t in batch))

    def stats(self) -> dict[str, int]:
        """Counts the source keeps (a chat source: conversations truncated, dropped, skipped),
        summed over this rank's workers as of the last batch handed out."""
        return _sum_stats(self._loader.state_dict())

    @property
    def _key(self) -> str:
        parts = getattr(self.dataset, "parts", None) or [self.dataset]
        return f"dp_rank{parts[0].dp_rank}"

    def state_dict(self) -> dict[str, Any]:
        # Ranks differ, so the key names the data-parallel rank (torch.distributed.checkpoint
        # keeps one value per key), and the value is one JSON string: the loader's state
        # has a shape that a fresh loader's template does not know yet.
        state = {"stream": self._loader.state_dict(), "identity": self.dataset.identity(),
                 "num_workers": self.num_workers}
        return {self._key: json.dumps(state)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if self._key not in state:
            raise ConfigError(f"the checkpoint's data state has no {self._key} "
                              "(saved at another data-parallel degree): resume with the same one")
        state = json.loads(state[self._key])
        check_identity(state["identity"], self.dataset.identity())
        if int(state.get("num_workers", -1)) != self.num_workers:
            raise ConfigError(f"the checkpoint's data state has data.num_workers={state.get('num_workers')} "
                              f"but this run has {self.num_workers}: resume with the same value")
        self._loader = self._make()
        self._loader.load_state_dict(state["stream"])
        self._it = None


def _sum_stats(state: Any) -> dict[str, int]:
    """Every ``"stats"`` (and ``"pending"``: the batch being handed out) mapping found in a
    (nested) loader state, summed."""
    total: dict[str, int] = {}
    if isinstance(state, Mapping):
        for key, value in state.items():
            if key in ("stats", "pending") and isinstance(value, Mapping):
                for k, v in value.items():
                    total[k] = total.get(k, 0) + int(v)
            else:
                for k, v in _sum_stats(value).items():
                    total[k] = total.get(k, 0) + v
    elif isinstance(state, (list, tuple)):
        for value in state:
            for k, v in _sum_stats(value).items():
                total[k] = total.get(k, 0) + v
    return total
