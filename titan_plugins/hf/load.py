"""Sharded load of a Hugging Face folder into a (parallelized) model.

Every rank fills the entries of its own model state dict (DTensors under
FSDP/TP/EP, only the stage's modules under PP), reading with safetensors'
``get_slice`` only what its shards need.

An adapter with a declared mapping (``adapter.mapping``, a
:class:`titan_plugins.hf.mapping.HFMapping`) says per entry where it comes from,
and the read plan follows from that declaration alone:

- a rename (also through a transpose): only the shard's slice;
- stacked experts: only the rank's experts, each sliced in the remaining dimensions;
- a part of a fused Hugging Face tensor (fused q/k/v, gate/up): only the shard's
  slice of that part; a split (ours fused): the slices of the parts it overlaps;
- a transform no slice expresses (the rotary q/k row permutation): that one tensor
  whole, then the shard is cut out.

Hand-written adapters (``to_hf`` / ``from_hf`` only) are probed instead: ``to_hf`` on
a meta tensor of the global shape names the Hugging Face tensors; a rename that
hands the tensor itself on, or ``t[e]`` views (stacked experts), is read as slices;
anything else is read whole for that one parameter (split) or one layer at a time
through ``from_hf`` (fused), then cut. Never the whole model.

Values are converted to the parameter's dtype (``precision.weight_dtype``).
Entries with no Hugging Face counterpart (``expert_bias``, a tied output weight)
keep what ``init_weights`` gave them (the adapter's ``from_hf`` defaults).
"""

from __future__ import annotations

import inspect
import json
import re
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from titan_plugins.distributed.shards import local_slices
from titan_plugins.errors import ConfigError
from titan_plugins.hf.mapping import HFMapping

if TYPE_CHECKING:
    from titan_plugins.spec import ModelSpec

__all__ = ["HFCheckpoint", "load_hf_weights", "load_report"]


class HFCheckpoint:
    """Lazy access to the tensors of a folder's ``*.safetensors`` (index or not)."""

    def __init__(self, folder: str | Path) -> None:
        from safetensors import safe_open

        self.folder = Path(folder)
        index = self.folder / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(p.name for p in self.folder.glob("*.safetensors"))
            weight_map = None
        self._stack = ExitStack()
        self._files = {f: self._stack.enter_context(safe_open(str(self.folder / f), framework="pt")) for f in files}
        if weight_map is None:
            weight_map = {k: f for f, h in self._files.items() for k in h.keys()}
        self.weight_map: dict[str, str] = weight_map

    def close(self) -> None:
        self._stack.close()

    def __enter__(self) -> HFCheckpoint:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _slice(self, key: str) -> Any:
        if key not in self.weight_map:
            raise ConfigError(f"model.hf={self.folder}: the checkpoint has no tensor {key!r}")
        return self._files[self.weight_map[key]].get_slice(key)

    def shape(self, key: str) -> list[int]:
        return list(self._slice(key).get_shape())

    def read(self, key: str, index: tuple[slice, ...] | None = None) -> torch.Tensor:
        sl = self._slice(key)
        if not sl.get_shape():  # a 0-dim tensor (a learned scalar): nothing to slice
            return self._files[self.weight_map[key]].get_tensor(key)
        return sl[index] if index else sl[:]


def _local(value: Any) -> tuple[Any, tuple[slice, ...]]:
    """What to fill and the global index it covers: a shard, or all of a QLoRA base
    weight (its receiver quantizes the whole tensor, then keeps this rank's rows)."""
    from titan_plugins.peft.qlora import BaseReceiver

    if isinstance(value, BaseReceiver):
        return value, tuple(slice(0, s) for s in value.shape)
    return local_slices(value)


def _probe(adapter: Any, key: str, shape: torch.Size) -> tuple[torch.Tensor, dict[str, Any]]:
    probe = torch.empty(shape, device="meta")
    return probe, adapter.to_hf({key: probe})


def _expert_order(adapter: Any, key: str, shape: torch.Size, names: list[str]) -> list[str]:
    """Hugging Face names of a stacked tensor in stack order (index 0 first): probe
    ``to_hf`` with a stride-0 tensor whose slice ``e`` holds ``e``."""
    probe = torch.arange(shape[0], dtype=torch.float32).view(-1, *[1] * (len(shape) - 1)).expand(*shape)
    mapped = adapter.to_hf({key: probe})
    order = {int(t[(0,) * t.dim()].item()): n for n, t in mapped.items()}
    return [order[e] for e in range(shape[0])] if sorted(order) == list(range(shape[0])) else names


def _copy(ckpt: HFCheckpoint, key: str, local: Any, part: torch.Tensor) -> None:
    if tuple(part.shape) != tuple(local.shape):
        raise ConfigError(
            f"model.hf={ckpt.folder}: {key} has shape {tuple(part.shape)} in the checkpoint's "
            f"slice, the model's shard is {tuple(local.shape)}"
        )
    local.copy_(part.to(dtype=local.dtype, device=local.device))


def _fill(ckpt: HFCheckpoint, adapter: Any, key: str, value: Any) -> tuple[list[str], bool] | None:
    """Fill one entry from its own Hugging Face tensors; returns ``(names read,
    whether only the shard's slices were read)``, or ``None`` when the entry cannot
    be mapped alone (fused with others, or absent)."""
    local, index = _local(value)
    try:
        probe, mapped = _probe(adapter, key, value.shape)
    except Exception:  # needs its fused partners: the grouped pass handles it
        return None
    names = list(mapped)
    if not names or any(n not in ckpt.weight_map for n in names):
        return None
    shape = tuple(value.shape)
    if local.numel() == 0:
        return names, True
    sliced = True
    if len(names) == 1 and mapped[names[0]] is probe and tuple(ckpt.shape(names[0])) == shape:
        part = ckpt.read(names[0], index)  # a rename (to_hf hands the tensor on): only this rank's slice
    elif (
        len(names) == shape[0]
        and all(tuple(mapped[n].shape) == shape[1:] and mapped[n].stride() == probe.stride()[1:] for n in names)
        and all(tuple(ckpt.shape(n)) == shape[1:] for n in names)
    ):  # stacked experts (to_hf hands on plain slices): only this rank's experts, each sliced
        ordered = _expert_order(adapter, key, value.shape, names)[index[0]]
        part = torch.stack([ckpt.read(n, index[1:]) for n in ordered])
    else:  # split on the Hugging Face side: this parameter's tensors whole, then our shard
        full = adapter.from_hf({n: ckpt.read(n) for n in names})
        if key not in full:
            return None
        part, sliced = full[key][index], False
    _copy(ckpt, key, local, part)
    return names, sliced


def _fill_declared(ckpt: HFCheckpoint, mapping: Any, config: Any, key: str, value: Any) -> tuple[list[str], bool] | None:
    """Fill one entry as the declaration says: ``(names read, only slices)``, or
    ``None`` when Hugging Face has no such tensor."""
    try:
        sources = mapping.sources(key, tuple(value.shape), config)
    except KeyError as exc:
        raise ConfigError(f"model.hf={ckpt.folder}: {str(exc).strip(chr(34) + chr(39))} "
                          "(the plugin's declared Hugging Face mapping)") from None
    if not sources:
        return None
    for name, want in sources.items():
        if tuple(ckpt.shape(name)) != tuple(want):
            raise ConfigError(f"model.hf={ckpt.folder}: {name} has shape {tuple(ckpt.shape(name))}, "
                              f"the model's {key} {tuple(value.shape)} needs {tuple(want)}")
    local, index = _local(value)
    if local.numel() == 0:
        return list(sources), True
    part, sliced = mapping.load(key, tuple(value.shape), index, ckpt, config)
    _copy(ckpt, key, local, part)
    return list(sources), sliced


def _layer_of(name: str) -> str | None:
    match = re.search(r"\.(\d+)\.", name)
    return match.group(1) if match else None


def _fill_grouped(ckpt: HFCheckpoint, adapter: Any, pending: dict[str, Any], used: set[str]) -> int:
    """Entries fused on the Hugging Face side (or absent from it): the remaining
    Hugging Face tensors of this part, one layer at a time, through ``from_hf``.
    Returns how many entries were filled; the others keep their initial values."""
    meta = {k: torch.empty(v.shape, device="meta") for k, v in pending.items()}
    try:
        wanted = set(adapter.to_hf(meta)) - used
    except Exception as exc:
        raise ConfigError(f"model.hf={ckpt.folder}: the adapter's to_hf fails on {sorted(pending)[0]}: {exc}") from None
    wanted &= set(ckpt.weight_map)
    groups: dict[str | None, list[str]] = {}
    for name in sorted(wanted):
        groups.setdefault(_layer_of(name), []).append(name)
    filled = 0
    for names in groups.values():
        ours = adapter.from_hf({n: ckpt.read(n) for n in names})
        for key in [k for k in pending if k in ours]:
            local, index = _local(pending.pop(key))
            _copy(ckpt, key, local, ours[key][index])
            filled += 1
    return filled


@torch.no_grad()
def _clean(name: str) -> str:
    """A parameter's state-dict key: without the wrappers' segments (AC, compile)."""
    return name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")


def _tied_and_buffers(part: torch.nn.Module) -> tuple[dict[str, str], set[str]]:
    """``{alias: the name it is tied to}`` for parameters shared under two names, and the
    names of the part's parameters (everything else in its state dict is a buffer)."""
    first: dict[int, str] = {}
    tied: dict[str, str] = {}
    names: set[str] = set()
    for name, param in part.named_parameters(remove_duplicate=False):
        name = _clean(name)
        names.add(name)
        if id(param) in first:
            tied[name] = first[id(param)]
        else:
            first[id(param)] = name
    return tied, names


def _refuse_unfilled(folder: str | Path, unfilled: list[str]) -> None:
    if unfilled:
        more = f" and {len(unfilled) - 1} more" if len(unfilled) > 1 else ""
        raise ConfigError(f"model.hf={folder}: has no tensor for the parameter {unfilled[0]}{more} (it would train "
                          "from its random initial value); model.hf_partial=true loads such a folder on purpose")


def load_hf_weights(parts: list[torch.nn.Module], spec: ModelSpec, config: Any, folder: str | Path,
                    *, verbose: bool | None = None, partial: bool = False) -> dict[str, int]:
    """Fill every model part from ``folder``. Returns counts: ``loaded`` entries,
    ``sliced`` (of those, read as the shard's slices only), ``tied`` (parameters that
    are another one, filled through it) and ``kept`` (left at their initial values:
    Hugging Face has no such tensor). A *parameter* the folder does not fill is an
    error (``partial=True``, ``model.hf_partial``, keeps it instead); buffers (an MoE
    router's load-balancing bias) keep their initial values. ``verbose`` (default: on
    rank 0 of a process group) prints :func:`load_report`'s lines."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    from titan_plugins.peft.lora import is_adapter_key
    from titan_plugins.peft.qlora import pending_base

    adapter_cls = spec.load("state_dict_adapter")
    # TorchTitan's adapter signature: an adapter taking hf_assets_path learns the folder (its layout)
    takes_folder = "hf_assets_path" in inspect.signature(adapter_cls).parameters
    adapter = adapter_cls(config, hf_assets_path=str(folder)) if takes_folder else adapter_cls(config)
    mapping = getattr(adapter, "mapping", None)
    declared = isinstance(mapping, HFMapping)
    loaded = kept = sliced = 0
    kept_names: list[str] = []
    tied_names: list[str] = []
    unfilled: list[str] = []
    with HFCheckpoint(folder) as ckpt:
        for part in parts:
            pending: dict[str, Any] = {}
            used: set[str] = set()
            waiting = pending_base(part)  # QLoRA: read whole, quantized as read (peft/qlora.py)
            state = get_model_state_dict(part)
            for key, value in {**state, **waiting}.items():
                if is_adapter_key(key):  # LoRA adapters: not in a base model's folder
                    continue
                done = _fill_declared(ckpt, mapping, config, key, value) if declared \
                    else _fill(ckpt, adapter, key, value)
                if done is None and declared:
                    kept, kept_names = kept + 1, [*kept_names, key]
                elif done is None:
                    pending[key] = value
                else:
                    used.update(done[0])
                    loaded, sliced = loaded + 1, sliced + done[1]
            if pending:
                filled = _fill_grouped(ckpt, adapter, pending, used)
                loaded, kept = loaded + filled, kept + len(pending)
                kept_names += sorted(pending)
            _check_base_filled(part, folder)
            aliases, params = _tied_and_buffers(part)
            tied_here = [k for k in kept_names if k in aliases and aliases[k] not in kept_names]
            tied_names += [f"{k} (tied to {aliases[k]})" for k in tied_here]
            kept_names = [k for k in kept_names if k not in tied_here]
            kept -= len(tied_here)
            unfilled += [k for k in kept_names if k in params]
    if not partial:
        _refuse_unfilled(folder, sorted(set(unfilled)))
    counts = {"loaded": loaded, "sliced": sliced, "kept": kept, "tied": len(tied_names)}
    if verbose is None:
        import torch.distributed as dist

        verbose = dist.is_initialized() and dist.get_rank() == 0
    if verbose:
        for line in load_report(counts, kept_names, parts, folder, tied=tied_names):
            print(line, flush=True)
    return counts


def _check_base_filled(part: torch.nn.Module, folder: str | Path) -> None:
    from titan_plugins.peft.qlora import pending_base

    unfilled = sorted(pending_base(part))
    if unfilled:  # a QLoRA base weight has no initial value to keep
        raise ConfigError(f"model.hf={folder}: has no tensor for the 4-bit base weight {unfilled[0]} "
                          f"(and {len(unfilled) - 1} more); peft=qlora needs every adapted weight")


def load_report(counts: dict[str, int], kept: list[str], parts: list[torch.nn.Module],
                folder: str | Path, *, tied: list[str] | tuple[str, ...] = ()) -> list[str]:
    """What a load did, in a line or two: how many entries came from the folder (read
    as shard slices), which kept their initial values, and whether the MoE router
    trains a bias (load balancing) the folder's architecture has none of."""
    lines = [f"model.hf: {counts['loaded']} tensors loaded from {folder} "
             f"({counts['sliced']} read as this rank's slices only)"]
    if tied:
        lines[0] += f"; tied, as the folder says: {', '.join(tied)}"
    if kept:
        more = f" and {len(kept) - 3} more" if len(kept) > 3 else ""
        lines[0] += f"; kept at their initial values (not in the folder): {', '.join(kept[:3])}{more}"
    balancing = [m.load_balance_coeff for part in parts for m in part.modules() if hasattr(m, "load_balance_coeff")]
    if balancing and all(c is None for c in balancing):
        lines.append("model.hf: the MoE router trains no bias (load balancing off: "
                     "load_balance_coeff=null), as the folder's architecture has none")
    return lines
