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
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

import torch

# A plugin's model config: its own dataclass, so its type is the plugin's, not the core's.
ModelConfig = Any
StateDict = dict[str, torch.Tensor]  # our or Hugging Face names -> (meta, plain or DTensor) tensors

__all__ = [
    "Absent", "Fuse", "HFMapping", "MappedAdapter", "Rename", "RotaryPermute", "Split", "Stack", "Tied",
    "Transform", "Transpose",
]

Index = tuple[slice, ...]


class Source(Protocol):
    """Where a sharded load reads from (``titan_plugins.hf.load.HFCheckpoint``)."""

    def read(self, key: str, index: Index | None = None) -> torch.Tensor: ...

    def shape(self, key: str) -> list[int]: ...


_PLACEHOLDER = re.compile(r"\{(\w+)\}")


class Pattern:
    """A name with integer placeholders: ``layers.{L}.attention.wq.weight``."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.names = _PLACEHOLDER.findall(text)
        parts, pos = [], 0
        for m in _PLACEHOLDER.finditer(text):
            parts += [re.escape(text[pos:m.start()]), f"(?P<{m.group(1)}>\\d+)"]
            pos = m.end()
        self.regex = re.compile("".join(parts) + re.escape(text[pos:]))

    def match(self, name: str) -> dict[str, str] | None:
        m = self.regex.fullmatch(name)
        return m.groupdict() if m else None

    def format(self, values: dict[str, str | int]) -> str:
        return self.text.format(**values)

    def __repr__(self) -> str:
        return self.text


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _norm(dim: int, ndim: int) -> int:
    return dim % ndim


# ------------------------------------------------------------------ transforms
class Transform:
    """How one tensor's layout differs between the two sides (identity here).

    ``hf_index`` maps a slice of ours to the slice of the Hugging Face tensor that
    holds it, or is ``None`` when no slice does (the tensor is then read whole)."""

    def to_hf(self, t: torch.Tensor, config: ModelConfig) -> torch.Tensor:
        return t

    def from_hf(self, t: torch.Tensor, config: ModelConfig) -> torch.Tensor:
        return t

    def hf_shape(self, shape: Sequence[int]) -> tuple[int, ...]:
        return tuple(shape)

    def hf_index(self, index: Index) -> Index | None:
        return index


IDENTITY = Transform()


@dataclasses.dataclass(frozen=True)
class Transpose(Transform):
    """Two dimensions swapped (``[out, in]`` ours, ``[in, out]`` Hugging Face's)."""

    dim0: int = -2
    dim1: int = -1

    def _swap(self, seq: Sequence[int] | Index) -> tuple[int | slice, ...]:  # a shape or a slice index
        out = list(seq)
        a, b = _norm(self.dim0, len(out)), _norm(self.dim1, len(out))
        out[a], out[b] = out[b], out[a]
        return tuple(out)

    def to_hf(self, t: torch.Tensor, config: ModelConfig) -> torch.Tensor:
        return t.transpose(self.dim0, self.dim1)

    from_hf = to_hf

    def hf_shape(self, shape: Sequence[int]) -> tuple[int, ...]:
        return self._swap(shape)

    def hf_index(self, index: Index) -> Index:
        return self._swap(index)


@dataclasses.dataclass(frozen=True)
class RotaryPermute(Transform):
    """q/k rows between TorchTitan's rotary layout (adjacent pairs of a head rotate
    together) and Hugging Face Llama's (the two halves of a head). ``heads``: the
    config attribute (or a function of the config) giving the tensor's head count.
    Works on weights and biases; read whole by a sharded load."""

    heads: str | Callable[[ModelConfig], int]

    def _heads(self, config: ModelConfig) -> int:
        return self.heads(config) if callable(self.heads) else getattr(config, self.heads)

    def _permute(self, w: torch.Tensor, config: ModelConfig, to_hf: bool) -> torch.Tensor:
        heads = self._heads(config)
        rows, rest = w.shape[0], tuple(w.shape[1:])
        half = rows // heads // 2
        pairs = (heads, half, 2) if to_hf else (heads, 2, half)
        return w.reshape(*pairs, *rest).transpose(1, 2).reshape(rows, *rest).clone()

    def to_hf(self, t: torch.Tensor, config: ModelConfig) -> torch.Tensor:
        return self._permute(t, config, to_hf=True)

    def from_hf(self, t: torch.Tensor, config: ModelConfig) -> torch.Tensor:
        return self._permute(t, config, to_hf=False)

    def hf_index(self, index: Index) -> None:
        return None


def _read_through(src: Source, name: str, transform: Transform, index: Index, config: ModelConfig) -> tuple[torch.Tensor, bool]:
    """Our ``index`` of the tensor Hugging Face stores as ``name``: ``(values, sliced)``."""
    hf_index = transform.hf_index(index)
    if hf_index is None:
        return transform.from_hf(src.read(name), config)[index], False
    return transform.from_hf(src.read(name, hf_index), config), True


def _sizes(sizes: Sequence[int] | Callable[[ModelConfig], Sequence[int]] | None, config: ModelConfig, total: int, n: int, what: str) -> list[int]:
    if sizes is not None:
        out = list(sizes(config) if callable(sizes) else sizes)
    elif total % n:
        raise KeyError(f"{what}: {total} does not split into {n} equal parts (declare sizes=)")
    else:
        out = [total // n] * n
    if sum(out) != total:
        raise KeyError(f"{what}: parts {out} do not add up to {total}")
    return out


# --------------------------------------------------------------------- entries
class Entry:
    """One line of a declaration: ``ours`` and ``hf`` patterns."""

    ours: tuple[Pattern, ...] = ()
    hf: tuple[Pattern, ...] = ()


class Rename(Entry):
    """One tensor each side: ``ours`` is the Hugging Face ``hf`` (through ``transform``)."""

    def __init__(self, ours: str, hf: str, transform: Transform | None = None) -> None:
        self.ours, self.hf, self.transform = (Pattern(ours),), (Pattern(hf),), transform or IDENTITY

    def to_hf(self, values: dict[str, str], parts: dict[int, torch.Tensor], config: ModelConfig) -> StateDict:
        return {self.hf[0].format(values): self.transform.to_hf(parts[0], config)}

    def from_hf(self, values: dict[str, str], parts: dict[int, torch.Tensor], config: ModelConfig) -> StateDict:
        return {self.ours[0].format(values): self.transform.from_hf(parts[0], config)}

    def sources(self, values: dict[str, str], shape: Sequence[int], config: ModelConfig) -> dict[str, tuple[int, ...]]:
        return {self.hf[0].format(values): self.transform.hf_shape(shape)}

    def load(self, values: dict[str, str], part: int, shape: Sequence[int], index: Index, src: Source,
             config: ModelConfig) -> tuple[torch.Tensor, bool]:
        return _read_through(src, self.hf[0].format(values), self.transform, index, config)


class Stack(Entry):
    """Ours ``[n, ...]`` holds ``n`` Hugging Face tensors, one per ``{E}`` (stacked
    experts); ``transform`` applies to each. ``count(config)``, when given, is the
    number of tensors a checkpoint must have."""

    def __init__(self, ours: str, hf: str, transform: Transform | None = None,
                 count: Callable[[ModelConfig], int] | None = None, placeholder: str = "E") -> None:
        self.ours, self.hf, self.transform = (Pattern(ours),), (Pattern(hf),), transform or IDENTITY
        self.count, self.e = count, placeholder

    def to_hf(self, values: dict[str, str], parts: dict[int, torch.Tensor], config: ModelConfig) -> StateDict:
        full = _full(parts[0])
        return {self.hf[0].format({**values, self.e: e}): self.transform.to_hf(full[e], config)
                for e in range(full.shape[0])}

    def sources(self, values: dict[str, str], shape: Sequence[int], config: ModelConfig) -> dict[str, tuple[int, ...]]:
        one = self.transform.hf_shape(shape[1:])
        return {self.hf[0].format({**values, self.e: e}): one for e in range(shape[0])}

    def gather(self, values: dict[str, str], by_e: dict[int, torch.Tensor], config: ModelConfig) -> StateDict:
        n = self.count(config) if self.count else len(by_e)
        if sorted(by_e) != list(range(n)):
            where = ", ".join(f"{k}={v}" for k, v in values.items())
            raise KeyError(f"{self.hf[0]} ({where}): experts {sorted(by_e)} given, 0..{n - 1} expected")
        return {self.ours[0].format(values): torch.stack([self.transform.from_hf(by_e[e], config)
                                                          for e in range(n)])}

    def load(self, values: dict[str, str], part: int, shape: Sequence[int], index: Index, src: Source,
             config: ModelConfig) -> tuple[torch.Tensor, bool]:
        rows = [_read_through(src, self.hf[0].format({**values, self.e: e}), self.transform, index[1:], config)
                for e in range(shape[0])[index[0]]]
        if not rows:
            return torch.empty(0), True
        return torch.stack([r for r, _ in rows]), all(s for _, s in rows)


class Fuse(Entry):
    """Several of ours concatenated (along ``dim`` of the Hugging Face layout) into one
    Hugging Face tensor: ``hf = cat([transform(p) for p in ours], dim)``. ``sizes``
    (a list, or a function of the config) when the parts differ in size."""

    def __init__(self, hf: str, ours: Sequence[str], dim: int = 0, transform: Transform | None = None,
                 sizes: Sequence[int] | Callable[[ModelConfig], Sequence[int]] | None = None) -> None:
        self.hf, self.ours = (Pattern(hf),), tuple(Pattern(p) for p in ours)
        self.dim, self.transform, self.sizes = dim, transform or IDENTITY, sizes

    def to_hf(self, values: dict[str, str], parts: dict[int, torch.Tensor], config: ModelConfig) -> StateDict:
        tensors = [self.transform.to_hf(parts[i], config) for i in range(len(self.ours))]
        return {self.hf[0].format(values): torch.cat(tensors, dim=self.dim)}

    def from_hf(self, values: dict[str, str], parts: dict[int, torch.Tensor], config: ModelConfig) -> StateDict:
        t = parts[0]
        dim = _norm(self.dim, t.dim())
        sizes = _sizes(self.sizes, config, t.shape[dim], len(self.ours), str(self.hf[0]))
        return {p.format(values): self.transform.from_hf(chunk, config)
                for p, chunk in zip(self.ours, t.split(sizes, dim=dim), strict=True)}

    def _layout(self, shape: Sequence[int], config: ModelConfig) -> tuple[int, list[int], tuple[int, ...]]:
        """``(dim, part sizes, Hugging Face shape)`` for parts shaped like ``shape``."""
        one = list(self.transform.hf_shape(shape))
        dim = _norm(self.dim, len(one))
        total = sum(self.sizes(config) if callable(self.sizes) else self.sizes) if self.sizes is not None \
            else one[dim] * len(self.ours)
        one[dim] = total
        return dim, _sizes(self.sizes, config, total, len(self.ours), str(self.hf[0])), tuple(one)

    def sources(self, values: dict[str, str], shape: Sequence[int], config: ModelConfig) -> dict[str, tuple[int, ...]]:
        return {self.hf[0].format(values): self._layout(shape, config)[2]}

    def load(self, values: dict[str, str], part: int, shape: Sequence[int], index: Index, src: Source,
             config: ModelConfig) -> tuple[torch.Tensor, bool]:
        name = self.hf[0].format(values)
        dim, sizes, _ = self._layout(shape, config)
        offset = sum(sizes[:part])
        hf_index = self.transform.hf_index(index)
        if hf_index is None:
            whole = src.read(name).narrow(dim, offset, sizes[part])
            return self.transform.from_hf(whole, config)[index], False
        cut = list(hf_index)
        cut[dim] = slice(offset + cut[dim].start, offset + cut[dim].stop)
        return self.transform.from_hf(src.read(name, tuple(cut)), config), True


class Split(Entry):
    """One of ours holding several Hugging Face tensors (ours fused): ``ours =
    cat([transform(h) for h in hf], dim)`` along ``dim`` of our layout."""

    def __init__(self, ours: str, hf: Sequence[str], dim: int = 0, transform: Transform | None = None,
                 sizes: Sequence[int] | Callable[[ModelConfig], Sequence[int]] | None = None) -> None:
        self.ours, self.hf = (Pattern(ours),), tuple(Pattern(p) for p in hf)
        self.dim, self.transform, self.sizes = dim, transform or IDENTITY, sizes

    def _split(self, t: torch.Tensor, config: ModelConfig) -> tuple[int, list[int]]:
        dim = _norm(self.dim, len(t))
        return dim, _sizes(self.sizes, config, t[dim], len(self.hf), str(self.ours[0]))

    def to_hf(self, values: dict[str, str], parts: dict[int, torch.Tensor], config: ModelConfig) -> StateDict:
        t = parts[0]
        dim, sizes = self._split(t.shape, config)
        return {p.format(values): self.transform.to_hf(chunk, config)
                for p, chunk in zip(self.hf, t.split(sizes, dim=dim), strict=True)}

    def gather(self, values: dict[str, str], by_part: dict[int, torch.Tensor], config: ModelConfig) -> StateDict:
        if sorted(by_part) != list(range(len(self.hf))):
            raise KeyError(f"{self.ours[0]}: needs all of {', '.join(map(str, self.hf))}")
        tensors = [self.transform.from_hf(by_part[i], config) for i in range(len(self.hf))]
        return {self.ours[0].format(values): torch.cat(tensors, dim=self.dim)}

    def sources(self, values: dict[str, str], shape: Sequence[int], config: ModelConfig) -> dict[str, tuple[int, ...]]:
        dim, sizes = self._split(shape, config)
        out = {}
        for p, size in zip(self.hf, sizes, strict=True):
            one = list(shape)
            one[dim] = size
            out[p.format(values)] = self.transform.hf_shape(one)
        return out

    def load(self, values: dict[str, str], part: int, shape: Sequence[int], index: Index, src: Source,
             config: ModelConfig) -> tuple[torch.Tensor, bool]:
        dim, sizes = self._split(shape, config)
        pieces, sliced, start = [], True, 0
        for p, size in zip(self.hf, sizes, strict=True):
            lo, hi = max(index[dim].start, start), min(index[dim].stop, start + size)
            if lo < hi:
                sub = list(index)
                sub[dim] = slice(lo - start, hi - start)
                piece, s = _read_through(src, p.format(values), self.transform, tuple(sub), config)
                pieces.append(piece)
                sliced &= s
            start += size
        return torch.cat(pieces, dim=dim), sliced


class Tied(Entry):
    """``ours`` is ``source`` when ``when(config)``: not written, re-created on load."""

    def __init__(self, ours: str, source: str, when: Callable[[ModelConfig], bool] = lambda c: True) -> None:
        self.ours, self.source, self.when = (Pattern(ours),), source, when


class Absent(Entry):
    """Ours only. ``check(key, value)`` runs before ``to_hf`` drops it (raise to refuse
    a value the export would lose, e.g. :func:`titan_plugins.hf.config.refuse_dropped`);
    ``default(config)`` (a tensor, or ``None`` for none) is what ``from_hf`` puts
    beside each entry matching ``alongside``."""

    def __init__(self, ours: str, *, check: Callable[[str, torch.Tensor], None] | None = None,
                 default: Callable[[ModelConfig], torch.Tensor | None] | None = None, alongside: str | None = None) -> None:
        self.ours, self.check, self.default = (Pattern(ours),), check, default
        self.alongside = Pattern(alongside) if alongside else None


# --------------------------------------------------------------------- mapping
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
