"""One declared name map between a plugin's state dict and a Hugging Face checkpoint.

A plugin lists its entries once; ``to_hf``, ``from_hf`` and the sharded load's read
plan (which slices of which Hugging Face tensors a rank reads) all follow from that
list, so the two directions cannot disagree::

    MAPPING = HFMapping(
        Rename("tok_embeddings.weight", "model.embed_tokens.weight"),
        Rename("layers.{L}.attention.wq.weight", "model.layers.{L}.self_attn.q_proj.weight"),
        Stack("layers.{L}.moe.experts.w1", "model.layers.{L}.mlp.experts.{E}.gate_proj.weight"),
        Fuse("model.layers.{L}.experts.gate_up_proj",
             ["layers.{L}.moe.experts.w1", "layers.{L}.moe.experts.w3"], dim=-1, transform=Transpose()),
        Tied("output.weight", "tok_embeddings.weight", when=lambda c: c.enable_weight_tying),
        Absent("layers.{L}.moe.expert_bias"),
        skip=[r".*\\.tokens_per_expert"], ignore_hf=[r".*rotary_emb\\.inv_freq"],
    )

    class MyAdapter(MappedAdapter):
        mapping = MAPPING

Patterns name their integer placeholders in braces (``{L}`` a layer, ``{E}`` an
expert; any name works). The entries:

- :class:`Rename`: one tensor each side, optionally through a :class:`Transform`.
- :class:`Stack`: ours ``[n, ...]`` is ``n`` Hugging Face tensors, one per ``{E}``.
- :class:`Fuse`: several of ours concatenated into one Hugging Face tensor (fused
  q/k/v or gate/up projections); :class:`Split` is the opposite (ours fused).
- :class:`Tied`: ours is another entry (a tied output weight): not written, and
  re-created from that entry on the way back.
- :class:`Absent`: ours has no Hugging Face counterpart (a router bias the
  architecture lacks): ``to_hf`` drops it (after an optional ``check``), ``from_hf``
  re-creates it with ``default`` beside the entry named by ``alongside``.

Transforms: :class:`Transpose` (``nn.Linear`` ``[out, in]`` against Conv1D
``[in, out]``, or per-expert layouts) maps slices to slices, so a sharded load still
reads only the rank's shard; :class:`RotaryPermute` (q/k rows between the
interleaved and rotate-half rotary layouts) reads the tensor whole, then cuts.
What a declaration cannot say (a checkpoint's quantisation, layers past the model's
depth) stays hand-written in the adapter around ``super().to_hf`` / ``from_hf``,
for names the declaration does not map.
"""

from __future__ import annotations

import copy
import dataclasses
import re
from collections.abc import Iterable, Sequence

import torch

# The declaration's vocabulary lives in mapping_entries; plugins import it from here.
from titan_plugins.hf.mapping_entries import IDENTITY as IDENTITY
from titan_plugins.hf.mapping_entries import (
    Absent,
    Entry,
    Fuse,
    Index,
    ModelConfig,
    Rename,
    RotaryPermute,
    Source,
    Split,
    Stack,
    StateDict,
    Tied,
    Transform,
    Transpose,
)
from titan_plugins.hf.mapping_entries import Pattern as Pattern

__all__ = [
    "Absent", "Fuse", "HFMapping", "MappedAdapter", "Rename", "RotaryPermute", "Split", "Stack", "Tied",
    "Transform", "Transpose",
]


@dataclasses.dataclass(frozen=True)
class _Bound:
    entry: Entry
    values: dict[str, str]
    part: int


class HFMapping:
    """The declaration: ``entries``; ``skip``: regexes of our state-dict entries that
    are never checkpoint entries (non-persistent buffers); ``ignore_hf``: regexes of
    Hugging Face names that are not ours (rotary caches, a vision tower); ``prefix``:
    what every Hugging Face name carries when written; ``read_prefixes``: prefixes
    ``from_hf`` also accepts (and strips)."""

    def __init__(self, *entries: Entry, skip: Iterable[str] = (), ignore_hf: Iterable[str] = (),
                 prefix: str = "", read_prefixes: Iterable[str] = ()) -> None:
        self.entries = entries
        self.skip = [re.compile(p) for p in skip]
        self.ignore_hf = [re.compile(p) for p in ignore_hf]
        self.prefix = prefix
        self.read_prefixes = tuple(read_prefixes)

    def with_prefix(self, prefix: str) -> HFMapping:
        """The same declaration writing (and reading) Hugging Face names under ``prefix``."""
        out = copy.copy(self)
        out.prefix = prefix
        return out

    # ------------------------------------------------------------ lookups
    def is_skipped(self, key: str) -> bool:
        return any(p.fullmatch(key) for p in self.skip)

    def find(self, key: str, config: ModelConfig) -> _Bound | None:
        """The entry that writes our ``key``; ``None`` when nothing is written for it
        (a buffer, a tied weight); KeyError when the declaration does not know it."""
        if self.is_skipped(key):
            return None
        for entry in self.entries:
            if isinstance(entry, Tied) and entry.ours[0].match(key) is not None and entry.when(config):
                return None
        for entry in self.entries:
            for i, pattern in enumerate(() if isinstance(entry, Tied) else entry.ours):
                values = pattern.match(key)
                if values is not None:
                    return _Bound(entry, values, i)
        raise KeyError(f"no Hugging Face name for {key!r}")

    def find_hf(self, name: str) -> _Bound | None:
        for entry in self.entries:
            for i, pattern in enumerate(entry.hf):
                values = pattern.match(name)
                if values is not None:
                    return _Bound(entry, values, i)
        return None

    # --------------------------------------------------------- directions
    def to_hf(self, state_dict: StateDict, config: ModelConfig) -> StateDict:
        """Hugging Face names and layouts for ``state_dict``; a fused tensor needs all its parts."""
        out: StateDict = {}
        groups: dict[tuple[int, tuple[tuple[str, str], ...]], dict[int, torch.Tensor]] = {}
        for key, value in state_dict.items():
            bound = self.find(key, config)
            if bound is None:
                continue
            entry = bound.entry
            if isinstance(entry, Absent):
                if entry.check is not None:
                    entry.check(key, value)
                continue
            if isinstance(entry, Fuse):
                groups.setdefault((id(entry), tuple(sorted(bound.values.items()))), {})[bound.part] = value
                continue
            out.update(entry.to_hf(bound.values, {0: value}, config))
        by_id = {id(e): e for e in self.entries}
        for (entry_id, values), parts in groups.items():
            entry = by_id[entry_id]
            values = dict(values)
            if len(parts) != len(entry.ours):
                names = [p.format(values) for p in entry.ours]
                missing = next(n for i, n in enumerate(names) if i not in parts)
                raise KeyError(f"{entry.hf[0].format(values)} fuses {', '.join(names)}: {missing} is missing")
            out.update(entry.to_hf(values, parts, config))
        return {self.prefix + k: v for k, v in out.items()}

    def _strip(self, name: str) -> str:
        for prefix in (self.prefix, *self.read_prefixes):
            if prefix and name.startswith(prefix):
                return name[len(prefix):]
        return name

    def from_hf(self, hf_state_dict: StateDict, config: ModelConfig) -> StateDict:
        """Our names and layouts; stacked and split entries gathered; tied and absent
        entries re-created. An unknown Hugging Face name is a KeyError."""
        out: StateDict = {}
        groups: dict[tuple[int, tuple[tuple[str, str], ...]], dict[int, torch.Tensor]] = {}
        for name, value in hf_state_dict.items():
            name = self._strip(name)
            if any(p.fullmatch(name) for p in self.ignore_hf):
                continue
            bound = self.find_hf(name)
            if bound is None:
                raise KeyError(f"unknown Hugging Face entry {name!r}")
            entry = bound.entry
            if isinstance(entry, Stack):
                values = dict(bound.values)
                e = int(values.pop(entry.e))
                groups.setdefault((id(entry), tuple(sorted(values.items()))), {})[e] = value
            elif isinstance(entry, Split):
                groups.setdefault((id(entry), tuple(sorted(bound.values.items()))), {})[bound.part] = value
            else:
                out.update(entry.from_hf(bound.values, {0: value}, config))
        by_id = {id(e): e for e in self.entries}
        for (entry_id, values), parts in groups.items():
            out.update(by_id[entry_id].gather(dict(values), parts, config))
        for entry in self.entries:
            if isinstance(entry, Tied) and entry.when(config) and entry.source in out:
                out.setdefault(entry.ours[0].text, out[entry.source])
            if isinstance(entry, Absent) and entry.default is not None and entry.alongside is not None:
                for key in list(out):
                    values = entry.alongside.match(key)
                    default = entry.default(config) if values is not None else None
                    if default is not None:
                        out.setdefault(entry.ours[0].format(values), default)
        return out

    # ------------------------------------------------------ sharded loads
    def sources(self, key: str, shape: Sequence[int], config: ModelConfig) -> dict[str, tuple[int, ...]]:
        """The Hugging Face tensors (with their expected shapes) our ``key`` of global
        ``shape`` is read from; empty when it has none (tied, absent, a buffer)."""
        bound = self.find(key, config)
        if bound is None or isinstance(bound.entry, Absent):
            return {}
        found = bound.entry.sources(bound.values, shape, config)
        return {self.prefix + k: v for k, v in found.items()}

    def load(self, key: str, shape: Sequence[int], index: Index, src: Source,
             config: ModelConfig) -> tuple[torch.Tensor, bool] | None:
        """The slice ``index`` of our ``key`` (global ``shape``), read from ``src``:
        ``(values, whether only slices were read)``, or ``None`` when Hugging Face has
        no such tensor (the entry keeps its initial value)."""
        bound = self.find(key, config)
        if bound is None or isinstance(bound.entry, Absent):
            return None
        return bound.entry.load(bound.values, bound.part, shape, index, _Prefixed(src, self.prefix), config)

    def check(self, hf_shapes: dict[str, Sequence[int]], shapes: dict[str, Sequence[int]],
              config: ModelConfig) -> list[str]:
        """Problems between a checkpoint (``hf_shapes``: name -> shape, as in its
        safetensors) and our state dict's ``shapes``: an entry without a mapping, a
        Hugging Face tensor missing, unclaimed, claimed twice or of another shape.
        A swap of two same-shaped tensors passes: only values tell them apart."""
        problems: list[str] = []
        claimed: dict[str, str] = {}
        for key, shape in shapes.items():
            try:
                found = self.sources(key, shape, config)
            except KeyError as exc:
                problems.append(str(exc).strip("'\""))
                continue
            for name, want in found.items():
                fused = isinstance(self.find(key, config).entry, Fuse)
                if name in claimed and not fused:
                    problems.append(f"{name} is mapped from both {claimed[name]} and {key}")
                claimed.setdefault(name, key)
                if name not in hf_shapes:
                    problems.append(f"{key}: the checkpoint has no {name}")
                elif tuple(hf_shapes[name]) != tuple(want):
                    problems.append(f"{key}: {name} has shape {tuple(hf_shapes[name])}, the mapping "
                                    f"expects {tuple(want)}")
        for name in sorted(set(hf_shapes) - set(claimed)):
            if not any(p.fullmatch(self._strip(name)) for p in self.ignore_hf):
                problems.append(f"{name} is in the checkpoint but no entry of ours reads it")
        return problems


@dataclasses.dataclass
class _Prefixed:
    src: Source
    prefix: str

    def read(self, key: str, index: Index | None = None) -> torch.Tensor:
        return self.src.read(self.prefix + key, index)

    def shape(self, key: str) -> list[int]:
        return self.src.shape(self.prefix + key)


class MappedAdapter:
    """A state-dict adapter whose Hugging Face side is its class attribute ``mapping``
    (an :class:`HFMapping`); TorchTitan's names are taken to be ours, less the
    declaration's ``skip`` entries. Override ``to_hf`` / ``from_hf`` (calling
    ``super()``) only for names the declaration does not map."""

    mapping: HFMapping

    def __init__(self, config: ModelConfig, hf_assets_path: str | None = None) -> None:
        self.config = config
        self.hf_assets_path = hf_assets_path

    def to_torchtitan(self, state_dict: StateDict) -> StateDict:
        return {k: v for k, v in state_dict.items() if not self.mapping.is_skipped(k)}

    def from_torchtitan(self, state_dict: StateDict) -> StateDict:
        return self.to_torchtitan(state_dict)

    def to_hf(self, state_dict: StateDict) -> StateDict:
        return self.mapping.to_hf(state_dict, self.config)

    def from_hf(self, hf_state_dict: StateDict) -> StateDict:
        return self.mapping.from_hf(hf_state_dict, self.config)
