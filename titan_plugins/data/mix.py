"""``data.mix``: several streaming sources, each row drawn by weight (``MixedDataset``).

Row ``i`` comes from the source drawn by weight from ``(seed, i)``, as the next
window of that source's stream ``i % G``; so the mix, like each source, is the
same at any parallel layout.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from titan_plugins.data.chat_source import build_chat
from titan_plugins.data.rows import RowStream, check_identity, seeded_rng
from titan_plugins.data.streaming import StreamingTokenDataset
from titan_plugins.data.units import SUFFIXES, cfg_get, check_source, plain_config
from titan_plugins.errors import ConfigError


class MixedDataset(RowStream):
    """``data.mix``: row ``i`` comes from the source drawn by weight from
    ``(seed, i)``, as the next window of that source's stream ``i % G``; so the mix,
    like each source, is the same at any parallel layout."""

    CHUNK = 4096

    def __init__(self, parts: list[StreamingTokenDataset], weights: list[float], seed: int) -> None:
        first = parts[0]
        super().__init__(dp_rank=first.dp_rank, dp_world=first.dp_world,
                         num_workers=first.num_workers, seq_len=first.seq_len)
        self.parts, self.seed = parts, seed
        total = float(sum(weights))
        self.p = np.asarray(weights, dtype=np.float64) / total
        self.scan: dict[int, int] = {}  # per stream: the next row of it not yet drawn
        self._chunk: tuple[int, np.ndarray] = (-1, np.zeros(0))

    def set_layout(self, local_batch_size: int, grad_accum_steps: int) -> None:
        super().set_layout(local_batch_size, grad_accum_steps)
        for part in self.parts:
            part.set_layout(local_batch_size, grad_accum_steps)

    def identity(self) -> dict[str, Any]:
        return {"mix": [p.identity() for p in self.parts], "weights": self.p.round(12).tolist()}

    def state_dict(self) -> dict[str, Any]:
        return {"taken": self.taken, "scan": {str(k): v for k, v in self.scan.items()},
                "parts": [p.state_dict() for p in self.parts], **self.identity()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        check_identity(state, self.identity())
        self.taken = int(state["taken"])
        self.scan = {int(k): int(v) for k, v in state["scan"].items()}
        for part, s in zip(self.parts, state["parts"]):
            part.load_state_dict(s)

    def choice(self, index: int) -> int:
        chunk, pos = divmod(index, self.CHUNK)
        if self._chunk[0] != chunk:
            self._chunk = (chunk, seeded_rng(self.seed, chunk).choice(len(self.p), self.CHUNK, p=self.p))
        return int(self._chunk[1][pos])

    def row(self, index: int) -> Any:
        g = self.global_rows
        s = index % g
        j = self.scan.get(s, s)
        while j < index:  # rows of this stream another worker owns: their windows go by
            self.parts[self.choice(j)].take(s)
            j += g
        self.scan[s] = index + g
        part = self.parts[self.choice(index)]
        sample = part.take(s)
        if len(sample) == 2 and any(getattr(p, "chat", {}).get("pack") for p in self.parts):
            # Rows of packed conversations carry document ids: give a text row its own
            # (from its EOS tokens), so the batch has them for every row.
            from titan_plugins.components.attention_masks import document_ids

            docs = document_ids(sample[0][None], part.tokenizer.eos_id)[0].long()
            sample = (*sample, docs)
        return sample


def entry_config(base: Any, entry: Any) -> Any:
    """A ``data.mix`` entry with the base data settings as defaults."""
    if entry is base:
        return plain_config(base)
    from types import SimpleNamespace

    merged = {k: cfg_get(base, k) for k in ("name", "path", "text_field", "split")}
    merged.update({k: cfg_get(entry, k) for k in ("name", "path", "text_field", "split") if cfg_get(entry, k) is not None})
    return plain_config(SimpleNamespace(**merged))


def chat_entry(base: Any, cfg: Any, workers: int = 0) -> Any:
    """A chat source's config: the entry's path and split with the base's ``chat`` and tokenizer."""
    from types import SimpleNamespace

    return SimpleNamespace(name="chat", path=cfg.path, split=cfg.split, chat=cfg_get(base, "chat"),
                           tokenizer=cfg_get(base, "tokenizer"), num_workers=workers)


def build_mix(data_config: Any, tokenizer: Any, *, dp_rank: int, dp_world: int, seq_len: int,
              seed: int) -> MixedDataset:
    """``data.mix=[{name, path, weight, text_field?, split?}, ...]`` of streaming sources."""
    workers = int(cfg_get(data_config, "num_workers", 0) or 0)
    parts, weights = [], []
    for i, (cfg, weight) in enumerate(mix_entries(data_config)):
        if cfg.name == "chat":
            parts.append(build_chat(chat_entry(data_config, cfg, workers), tokenizer, dp_rank=dp_rank,
                                    dp_world=dp_world, seq_len=seq_len, seed=seed + i))
            weights.append(weight)
            continue
        check_source(cfg)
        parts.append(StreamingTokenDataset(cfg, cfg.name, tokenizer, dp_rank=dp_rank, dp_world=dp_world,
                                           num_workers=workers, seq_len=seq_len, seed=seed + i))
        weights.append(weight)
    return MixedDataset(parts, weights, seed)


def mix_entries(data_config: Any) -> list[tuple[Any, float]]:
    """``(source config, weight)`` of each ``data.mix`` entry; a ConfigError in one line
    for an empty mix, a source that cannot be mixed, or a weight that is not positive."""
    entries = list(cfg_get(data_config, "mix") or [])
    if not entries:
        raise ConfigError("data.name=mix needs data.mix (a list of {name, path, weight})")
    out = []
    for i, entry in enumerate(entries):
        cfg = entry_config(data_config, entry)
        if cfg.name not in SUFFIXES and cfg.name not in ("hf", "chat"):
            raise ConfigError(f"data.mix[{i}].name={cfg.name!r} must be one of text, jsonl, parquet, hf, chat")
        weight = cfg_get(entry, "weight", 1.0)
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not weight > 0:
            raise ConfigError(f"data.mix[{i}].weight={weight!r} must be a positive number")
        out.append((cfg, float(weight)))
    return out
