"""Our adapted modules under their Hugging Face names, from the plugin's own
state-dict adapter (``to_hf``): nothing per plugin. peft adapts the modules of the model
transformers builds, so a linear is named as that model names it: the adapter's
``to_hf_modules`` where it has one (``model=hf``: a folder may store
``attention.query_key_value`` that transformers 5 loads as ``self_attn.qkv_proj``),
else ``to_hf`` (the first-party plugins, whose checkpoint names are the loaded ones).

For a module ``M`` with base weight ``M.weight`` of shape ``[out, in]``, ``to_hf`` is
probed twice with index tensors (``R[i, j] = i``, ``C[i, j] = j``). Each Hugging Face
tensor it yields must be a gather ``W_hf[a, b] = W[rows[a], cols[b]]`` (a rename, a
split of fused projections, a row permutation such as a rotary layout). Then the
adapter pair maps as ``A_hf = A[:, cols]``, ``B_hf = B[rows]``, since
``B_hf A_hf = (B A)[rows][:, cols]``. A module that ``to_hf`` maps only together
with others (fused on the Hugging Face side) has no adapter of its own there: it is
refused in one line.

A grouped expert weight ``W`` ``[E, out, in]`` is probed the same way with a third
index (the expert): each Hugging Face tensor must be one expert's rows and columns
(``mlp.experts.{e}.gate_proj.weight``, a linear per expert), whose adapter is then
``A_hf = A[e][:, cols]``, ``B_hf = B[e][rows]``: the layout peft reads for per-expert
linears (and converts to transformers 5's fused experts when it loads). A folder that
keeps the experts fused (Llama 4's ``gate_up_proj``) has no such layout: refused in one
line, pointing to ``--merge``.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from titan_plugins.errors import ConfigError

if TYPE_CHECKING:
    from titan_plugins.hf.mapping_entries import ModelConfig
    from titan_plugins.protocols import HFStateDictAdapter
    from titan_plugins.spec import ModelSpec

__all__ = ["ExpertTarget", "HFTarget", "expert_hf_targets", "hf_targets", "state_dict_adapter"]


@dataclass(frozen=True)
class HFTarget:
    module: str  # the Hugging Face module name (``model.layers.0.self_attn.q_proj``)
    rows: torch.Tensor  # which of our output rows it holds (index into B's rows)
    cols: torch.Tensor  # which of our input columns (index into A's columns)


@dataclass(frozen=True)
class ExpertTarget:
    module: str  # one expert's Hugging Face linear (``model.layers.0.mlp.experts.3.gate_proj``)
    expert: int  # which expert of ours (index into A's and B's dim 0)
    rows: torch.Tensor
    cols: torch.Tensor


def state_dict_adapter(spec: ModelSpec, config: ModelConfig, folder: str | None = None) -> HFStateDictAdapter:
    adapter_cls = spec.load("state_dict_adapter")
    if adapter_cls is None or not hasattr(adapter_cls, "to_hf"):
        raise ConfigError(f"model {spec.name!r}: its plugin has no state-dict adapter with to_hf (Hugging Face names)")
    takes_folder = "hf_assets_path" in inspect.signature(adapter_cls).parameters
    return adapter_cls(config, hf_assets_path=folder) if takes_folder and folder else adapter_cls(config)


def hf_targets(adapter: HFStateDictAdapter, module: str, shape: tuple[int, int], *,
               loaded: bool = True) -> list[HFTarget]:
    """The Hugging Face modules that hold our ``module``'s weight, and how: named as the
    loaded model names them (``loaded``), else as the checkpoint does."""
    key = f"{module}.weight"
    out_f, in_f = shape
    to_hf = (getattr(adapter, "to_hf_modules", None) if loaded else None) or adapter.to_hf
    probe = torch.empty(shape, device="meta")
    try:
        quick = to_hf({key: probe})
    except Exception:  # noqa: BLE001 - a fused partner is missing
        quick = {}
    if len(quick) == 1:
        name, value = next(iter(quick.items()))
        if value is probe and name.endswith(".weight"):  # a rename
            return [HFTarget(name[: -len(".weight")], torch.arange(out_f), torch.arange(in_f))]
    rows_probe = torch.arange(out_f, dtype=torch.float64).view(-1, 1).expand(out_f, in_f).contiguous()
    cols_probe = torch.arange(in_f, dtype=torch.float64).view(1, -1).expand(out_f, in_f).contiguous()
    try:
        by_rows, by_cols = to_hf({key: rows_probe}), to_hf({key: cols_probe})
    except Exception as exc:  # noqa: BLE001
        raise _fused(module, f"to_hf fails on it alone: {exc}") from None
    if not by_rows or set(by_rows) != set(by_cols):
        raise _fused(module, "to_hf names no Hugging Face tensor for it alone")
    targets = []
    for name, r in by_rows.items():
        c = by_cols[name]
        if r.ndim != 2 or not name.endswith(".weight"):
            raise _fused(module, f"it maps to {name} of shape {tuple(r.shape)}")
        rows, cols = r[:, 0], c[0, :]
        if not (torch.equal(r, rows[:, None].expand_as(r)) and torch.equal(c, cols[None, :].expand_as(c))):
            raise _fused(module, f"{name} is not a selection of its rows and columns")
        targets.append(HFTarget(name[: -len(".weight")], rows.long(), cols.long()))
    return targets


def _fused(module: str, why: str) -> ConfigError:
    return ConfigError(
        f"peft.target_modules: {module} has no Hugging Face module of its own ({why}); "
        "a PEFT adapter cannot hold it: leave it out of the targets to export"
    )


def expert_hf_targets(adapter: HFStateDictAdapter, key: str, shape: tuple[int, int, int]) -> list[ExpertTarget]:
    """The per-expert Hugging Face linears that hold our grouped expert weight ``key``
    (``layers.0.moe.experts.w1``, ``[E, out, in]``), and how."""
    n, out_f, in_f = shape

    def probe(dim: int) -> torch.Tensor:  # index along one dim, a broadcast view (no copy)
        view = [1, 1, 1]
        view[dim] = shape[dim]
        return torch.arange(shape[dim], dtype=torch.float64).view(view).expand(n, out_f, in_f)

    try:
        by_e, by_r, by_c = (adapter.to_hf({key: probe(d)}) for d in range(3))
    except Exception as exc:  # noqa: BLE001 - fused with a partner on the Hugging Face side
        raise _not_per_expert(key, f"to_hf fails on it alone: {exc}") from None
    if not by_e or set(by_e) != set(by_r) or set(by_e) != set(by_c):
        raise _not_per_expert(key, "to_hf names no Hugging Face tensor for it alone")
    targets = []
    first: tuple[torch.Tensor, torch.Tensor] | None = None
    for name, e in by_e.items():
        r, c = by_r[name], by_c[name]
        if e.ndim != 2 or not name.endswith(".weight"):
            raise _not_per_expert(key, f"it is {name} of shape {tuple(e.shape)}")
        expert, rows, cols = e[0, 0], r[:, 0], c[0, :]
        if first is None:  # the full check once (O(out * in)); every expert maps alike
            ok = (torch.equal(e, expert.expand_as(e)) and torch.equal(r, rows[:, None].expand_as(r))
                  and torch.equal(c, cols[None, :].expand_as(c)))
            first = rows, cols
        else:  # O(out + in) per further expert: a large model has thousands
            ok = (e.shape == r.shape == c.shape and bool(e[-1, -1] == expert) and torch.equal(rows, first[0])
                  and torch.equal(cols, first[1]))
        if not ok:
            raise _not_per_expert(key, f"{name} is not one expert's rows and columns")
        targets.append(ExpertTarget(name[: -len(".weight")], int(expert), rows.long(), cols.long()))
    return targets


def _not_per_expert(key: str, why: str) -> ConfigError:
    return ConfigError(
        f"peft.target_modules: the grouped experts {key} have no per-expert linears in the Hugging Face "
        f"folder ({why}), so a PEFT adapter has no layout for them: export with --merge"
    )
