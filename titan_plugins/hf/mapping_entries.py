"""The entries and transforms a :class:`titan_plugins.hf.mapping.HFMapping` declaration
is made of, each knowing its own piece of the name map: the names it matches on either
side (:class:`Pattern`), how a tensor's layout differs between the two sides
(:class:`Transform`, :class:`Transpose`, :class:`RotaryPermute`), and per entry kind
(:class:`Rename`, :class:`Stack`, :class:`Fuse`, :class:`Split`, :class:`Tied`,
:class:`Absent`) its ``to_hf``/``from_hf`` and the sharded load's read of a slice.

``titan_plugins.hf.mapping`` walks a state dict through the entries and re-exports every
name here; plugins import them from there (docs/writing-a-plugin.md).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

# A plugin's model config: its own dataclass, so its type is the plugin's, not the core's.
ModelConfig = Any
StateDict = dict[str, torch.Tensor]  # our or Hugging Face names -> (meta, plain or DTensor) tensors

__all__ = [
    "IDENTITY", "Absent", "Entry", "Fuse", "Index", "ModelConfig", "Pattern", "Rename", "RotaryPermute", "Source",
    "Split", "Stack", "StateDict", "Tied", "Transform", "Transpose",
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
