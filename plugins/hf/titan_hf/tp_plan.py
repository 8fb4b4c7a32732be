"""The tensor-parallel plan of each decoder layer: the architecture's own
``base_model_tp_plan``, or, where it declares none that reaches a layer module, one
derived from the layer's projections (same format: ``{"self_attn.q_proj": "colwise", ...}``).

The derivation reads one thing transformers cannot tell from shapes alone, what runs
after what, from a tiny copy of the model (the folder's config with small sizes, random
weights, on the CPU, every layer kept): each module holding ``nn.Linear`` children is a
*block* when its last projection back to the hidden size (the out-projection) produces
the block's output, and the projections from the hidden size called before it are its
in-projections. A block is then

- **sharded**: in-projections ``colwise``, the out-projection ``rowwise``, per-head norms
  (children whose only weights are ``head_dim`` long) ``replicated_with_grad_allreduce``;
  only where the in-projections give whole heads (``heads * head_dim`` and
  ``kv_heads * head_dim``) or the MLP's width, nothing else in the block holds weights,
  and two emulated TP ranks of the tiny block (its weights sliced, the out-projection's
  partial outputs summed) reproduce its output;
- otherwise **gathered**, transformers' own choice for fused projections (Phi-3's qkv and
  gate_up): in-projections ``colwise_gather_output``, the out-projection
  ``rowwise_split_input``. Every value inside the block is then the whole one on each
  rank, so it trains as one rank does whatever the block computes (a fused qkv is never
  split as if it were one matrix; per-head lambdas, sinks and sub-norms stay whole).

Blocks nest (an MoE block's shared experts); what no block covers (experts, routers,
residual gates) stays replicated, as a declared plan leaves it. The copy also shows a
projection output the model changes in place (given a copy: ``titan_hf.parallelize``) and
a block's parameter handed back to the layer (no SP: the layer would use it on a sequence
shard). Not seen: a layer reading a block's parameter by attribute.

A declared plan is used as transformers states it, except that one splitting a block by
heads or columns around a weight it leaves out is refused (:func:`check_left_out`).
"""

from __future__ import annotations

import copy
import dataclasses
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from titan_plugins.errors import ConfigError

if TYPE_CHECKING:
    from titan_hf.model import HFCausalLM

__all__ = ["DERIVED", "Block", "LayerPlans", "check_divisible", "check_left_out", "derive", "tp_plans"]

DERIVED = "tensor-parallel plan derived from the layer's projections"
EMULATED_TP = 2  # the tiny copy's heads (4, 2 key-value) split over two emulated ranks
_SEQ = 12  # tokens of the tiny copy's forward (past its 8-token sliding window)
#: matrix_folders' shape overrides that would change which layers are dense, MoE, sliding
_LAYOUT_KEYS = {"num_hidden_layers", "first_k_dense_replace", "decoder_sparse_step", "mlp_only_layers"}


@dataclass(frozen=True)
class Block:
    """One planned module of a layer: its path, projections and how it is split."""

    path: str
    in_projs: tuple[str, ...]
    out_proj: str
    norms: tuple[str, ...] = ()
    sharded: bool = False
    # projections whose output the model changes in place (Falcon's `mlp_output += ...`):
    # a TP style's output is a view autograd will not let change, so it gets a copy
    modified: tuple[str, ...] = ()
    # its parameters it returns to the layer (GPT-NeoX-Japanese's `dense_bias`): used there
    # on a sequence shard under SP, their gradient would be one rank's share
    hands_out: tuple[str, ...] = ()

    def styles(self) -> dict[str, str]:
        col, row = ("colwise", "rowwise") if self.sharded else ("colwise_gather_output", "rowwise_split_input")
        return {**dict.fromkeys(self.in_projs, col), self.out_proj: row,
                **dict.fromkeys(self.norms, "replicated_with_grad_allreduce")}

    def describe(self) -> str:
        styles = ", ".join(f"{path[len(self.path) + 1:]} {style}" for path, style in self.styles().items())
        return f"{self.path} {'sharded' if self.sharded else 'gathered'} ({styles})"


@dataclass(frozen=True)
class LayerPlans:
    """Each decoder layer's plan (keyed like ``model.layers``); ``derived``: not declared."""

    plans: dict[str, dict[str, str]]
    derived: bool
    blocks: dict[str, tuple[Block, ...]]  # derived plans only: what each layer's plan is made of

    def summary(self) -> str:
        kinds = dict.fromkeys("; ".join(b.describe() for b in blocks) or "nothing" for blocks in self.blocks.values())
        return " | ".join(kinds)


def _resolves(layer: nn.Module, path: str) -> bool:
    try:
        layer.get_submodule(path)
    except AttributeError:
        return False
    return True


def tp_plans(model: HFCausalLM) -> LayerPlans:
    """The declared plan where one of its entries names a module of a layer, else the
    derived one (``ConfigError``, one line, where nothing derives)."""
    from titan_hf.validate import layer_plan

    declared = layer_plan(model.hf_config)
    if any(_resolves(layer, path) for layer in model.layers.values() for path in declared):
        return LayerPlans({key: declared for key in model.layers}, derived=False, blocks={})
    return derive(model)


def check_divisible(model: HFCausalLM, plans: LayerPlans, tp: int) -> None:
    """Every projection a derived plan splits splits evenly over ``tp`` (a declared plan's
    sizes are the config's, checked by ``validate``)."""
    if not plans.derived:
        return
    for key, plan in plans.plans.items():
        layer = model.layers[key]
        for path, style in plan.items():
            weight = getattr(layer.get_submodule(path), "weight", None)
            dim = 0 if style.startswith("colwise") else 1 if style.startswith("rowwise") else None
            if dim is not None and weight is not None and weight.shape[dim] % tp:
                side = "outputs" if dim == 0 else "inputs"
                raise ConfigError(f"parallelism.tp={tp}: layer {key}'s {path} has {weight.shape[dim]} {side}, "
                                  f"not divisible by it ({DERIVED})")


def check_left_out(model: HFCausalLM, plans: LayerPlans, tp: int) -> None:
    """A declared plan that splits a block by heads or columns (``colwise`` / ``rowwise``)
    but leaves a weight inside it out (Sarvam-MoE's per-head q/k norms, Apertus's
    activation parameters, a block's own parameters) would train that weight on each
    rank's share of its gradient: one line (a derived plan gathers such a block). A
    projection left out (MLA's ``q_a_proj``) runs before the split, on the whole input,
    so it is not one of them; a norm there (MLA's ``q_a_layernorm``) would be taken for
    one, but MLA plans are refused before, for their ``mla_kv_a_proj`` style."""
    if plans.derived:
        return
    for key, plan in plans.plans.items():
        layer = model.layers[key]
        planned = [p for p in plan if _resolves(layer, p)]
        blocks = {p.rpartition(".")[0] for p in planned if plan[p] in ("colwise", "rowwise")} - {""}
        for block in sorted(blocks):
            for name, _ in layer.get_submodule(block).named_parameters():
                owner = f"{block}.{name}".rpartition(".")[0]
                if isinstance(layer.get_submodule(owner), nn.Linear) or \
                        any(owner == p or owner.startswith(f"{p}.") for p in planned):
                    continue
                raise ConfigError(f"parallelism.tp={tp}: {model.config.architecture}'s base_model_tp_plan splits "
                                  f"layer {key}'s {block} but leaves {block}.{name} out: its gradient would be "
                                  "each rank's share only; use dp_shard/pp for this model")


# --- the tiny copy -------------------------------------------------------------------


def tiny_copy(hf: Any) -> nn.Module:
    """The model of ``hf`` with small sizes (titan_hf.matrix_folders' overrides, every
    layer kept), random weights (std 0.2: nothing zero by initialisation), fp32, eval."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from titan_hf.matrix_folders import _overrides

    values = {k: v for k, v in hf.to_dict().items() if k not in ("model_type", "architectures")}
    # an override of a field left None would switch a feature on (q_lora_rank, a multiplier)
    small = {k: v for k, v in _overrides(hf).items() if k not in _LAYOUT_KEYS and getattr(hf, k, None) is not None}
    attempts = [small, *({k: v for k, v in small.items() if k != drop} for drop in small)]
    error: Exception | None = None
    for attempt in attempts:  # a validator refusing one override: without it
        try:
            config = AutoConfig.for_model(hf.model_type, **{**values, **attempt})
            break
        except Exception as exc:  # noqa: BLE001 - the first attempt's error is the one reported
            error = error or exc
    else:
        raise error  # type: ignore[misc]
    config.use_cache = False
    gen = torch.Generator().manual_seed(0)
    with torch.device("cpu"):
        model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            noise = torch.randn(p.shape, generator=gen) * 0.2
            p.copy_(noise if p.dim() >= 2 else p + noise)
    return model.eval()


@dataclass
class _Call:
    args: tuple  # copies: a layer may change them in place after the call (Falcon's `mlp_output += ...`)
    kwargs: dict
    value: Any  # a copy of the output's first tensor
    output: Any  # the output itself, for identity
    order: int
    version: int = 0  # the output's version counter when it was returned

    @property
    def modified(self) -> bool:
        """Whether the model changed the output in place after the call."""
        out = _first(self.output)
        return isinstance(out, torch.Tensor) and out._version != self.version


def _first(output: Any) -> Any:
    return output[0] if isinstance(output, (tuple, list)) else output


def _copied(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, (tuple, list)):
        return type(value)(_copied(v) for v in value)
    if isinstance(value, dict):
        return {k: _copied(v) for k, v in value.items()}
    return value


def _record(tiny: nn.Module, layers: nn.ModuleList) -> list[dict[str, _Call]]:
    """Each layer's modules' first call (inputs, output, completion order) in one forward."""
    calls: list[dict[str, _Call]] = [{} for _ in layers]
    counter = iter(range(1 << 30))
    hooks = []
    for i, layer in enumerate(layers):
        for name, module in layer.named_modules():
            def hook(_m, args, kwargs, output, i=i, name=name):
                if name not in calls[i]:
                    first = _first(output)
                    calls[i][name] = _Call(_copied(args), _copied(kwargs), _copied(first), output, next(counter),
                                           first._version if isinstance(first, torch.Tensor) else 0)
            hooks.append(module.register_forward_hook(hook, with_kwargs=True))
    vocab = int(tiny.config.vocab_size)
    ids = torch.randint(3, vocab, (1, _SEQ), generator=torch.Generator().manual_seed(1))
    try:
        with torch.no_grad():
            tiny(input_ids=ids)
    finally:
        for h in hooks:
            h.remove()
    return calls


# --- blocks --------------------------------------------------------------------------


@dataclass(frozen=True)
class _Dims:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int

    @classmethod
    def of(cls, config: Any) -> _Dims:
        heads = int(config.num_attention_heads)
        return cls(int(config.hidden_size), heads, int(getattr(config, "num_key_value_heads", None) or heads),
                   int(getattr(config, "head_dim", None) or config.hidden_size // heads))


def _hidden_input(call: _Call) -> Any:
    """What an SP gather takes: ``hidden_states=`` or the first positional argument."""
    return call.kwargs["hidden_states"] if "hidden_states" in call.kwargs else (call.args[0] if call.args else None)


def _block(path: str, module: nn.Module, calls: dict[str, _Call], dims: _Dims) -> Block | None:
    """``module`` (at ``path`` in the layer) as a block, or ``None`` when it is not one."""
    call = calls.get(path)
    if call is None or not isinstance(_hidden_input(call), torch.Tensor) \
            or _hidden_input(call).shape[-1] != dims.hidden:
        return None
    prefix = f"{path}."
    linears = sorted(((f"{prefix}{n}", m) for n, m in module.named_children()
                      if isinstance(m, nn.Linear) and f"{prefix}{n}" in calls), key=lambda nm: calls[nm[0]].order)
    outs = [(p, m) for p, m in linears if m.out_features == dims.hidden
            and calls[p].output is _first(call.output)]
    if not outs:
        return None
    out_path, out = outs[-1]
    ins = [(p, m) for p, m in linears if m.in_features == dims.hidden and calls[p].order < calls[out_path].order]
    if not ins:
        return None
    modified = tuple(p for p, _ in [*ins, (out_path, out)] if calls[p].modified)
    returned = call.output if isinstance(call.output, (tuple, list)) else (call.output,)
    hands_out = tuple(f"{prefix}{n}" for n, w in module.named_parameters() if any(r is w for r in returned))
    gathered = Block(path, tuple(p for p, _ in ins), out_path, modified=modified, hands_out=hands_out)
    sharded = _sharded(path, module, ins, (out_path, out), dims)
    if sharded is not None and _emulates(module, sharded, call):
        return dataclasses.replace(sharded, modified=modified, hands_out=hands_out)
    return gathered


def _sharded(path: str, module: nn.Module, ins: list, out: tuple[str, nn.Linear], dims: _Dims) -> Block | None:
    """The sharded candidate: whole heads (or the MLP's width) per rank, and no weight
    in the block outside its projections and per-head norms."""
    head_dim = int(getattr(module, "head_dim", None) or dims.head_dim)
    widths = [m.out_features for _, m in ins]
    q, kv = dims.heads * head_dim, dims.kv_heads * head_dim
    heads = out[1].in_features == q and set(widths) <= {q, kv} and q in widths
    columns = len(set(widths)) == 1 and widths[0] == out[1].in_features
    if not (heads or columns):
        return None
    planned = {p[len(path) + 1:] for p, _ in ins} | {out[0][len(path) + 1:]}
    norms = []
    for name, child in module.named_children():
        weights = list(child.parameters())
        if name in planned or not weights:
            continue
        if heads and all(w.dim() == 1 and w.shape[0] == head_dim for w in weights):
            norms.append(f"{path}.{name}")
        else:
            return None  # a weight the shards would see only a part of
    if next(module.parameters(recurse=False), None) is not None:
        return None  # the block's own parameters (sinks, lambdas)
    return Block(path, tuple(p for p, _ in ins), out[0], tuple(norms), sharded=True)


def _emulates(module: nn.Module, block: Block, call: _Call) -> bool:
    """Two TP ranks of ``module`` (in-projections' rows, the out-projection's columns
    split; its bias on one rank) sum to its output on the recorded call."""
    strip = len(block.path) + 1
    total = None
    try:
        for rank in range(EMULATED_TP):
            shard = copy.deepcopy(module)
            with torch.no_grad():
                for path in block.in_projs:
                    lin = shard.get_submodule(path[strip:])
                    lin.weight = nn.Parameter(lin.weight.chunk(EMULATED_TP, 0)[rank].clone())
                    if lin.bias is not None:
                        lin.bias = nn.Parameter(lin.bias.chunk(EMULATED_TP, 0)[rank].clone())
                lin = shard.get_submodule(block.out_proj[strip:])
                lin.weight = nn.Parameter(lin.weight.chunk(EMULATED_TP, 1)[rank].clone())
                if lin.bias is not None and rank:
                    lin.bias = nn.Parameter(torch.zeros_like(lin.bias))
                part = _first(shard(*call.args, **call.kwargs))
            total = part if total is None else total + part
    except Exception:  # noqa: BLE001 - a block that cannot run on a shard of its heads is gathered
        return False
    full = call.value
    if not isinstance(total, torch.Tensor) or total.shape != full.shape:
        return False
    return bool((total - full).abs().max() <= 1e-4 * full.abs().max() + 1e-6)


def _blocks(layer: nn.Module, calls: dict[str, _Call], dims: _Dims, path: str = "") -> list[Block]:
    """The blocks under ``path``: a child that is one, else the blocks inside it."""
    out: list[Block] = []
    module = layer.get_submodule(path) if path else layer
    for name, child in module.named_children():
        if isinstance(child, nn.Linear) or not any(isinstance(m, nn.Linear) for m in child.modules()):
            continue
        child_path = f"{path}.{name}" if path else name
        block = _block(child_path, child, calls, dims)
        out += [block] if block is not None else _blocks(layer, calls, dims, child_path)
    return out


def _signature(layer: nn.Module) -> tuple:
    """A layer's module tree and parameter names (list indices folded): sizes aside,
    the tiny copy's layer has the same one as the folder's."""
    def fold(name: str) -> str:
        return re.sub(r"(^|\.)\d+(?=\.|$)", r"\1*", name)

    return (tuple(sorted((fold(n), type(m).__name__) for n, m in layer.named_modules())),
            tuple(sorted({fold(n) for n, _ in layer.named_parameters()})))


_CACHE: dict[str, LayerPlans] = {}  # validate and parallelize derive once per process and config


def derive(model: HFCausalLM) -> LayerPlans:
    """Each layer's plan from its projections (see the module's docstring)."""
    key = model.hf_config.to_json_string()
    if key not in _CACHE:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # matrices of 64: more threads only wait on each other
        try:
            _CACHE[key] = _derive(model)
        finally:
            torch.set_num_threads(threads)
    return _CACHE[key]


def _derive(model: HFCausalLM) -> LayerPlans:
    from titan_hf.structure import find_structure

    arch = model.config.architecture
    try:
        tiny = tiny_copy(model.hf_config)
        tiny_layers = tiny.get_submodule(find_structure(tiny).layers)
        calls = _record(tiny, tiny_layers)
    except Exception as exc:  # noqa: BLE001 - one line, whatever transformers raised
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(f"{arch} declares no tensor-parallel plan for its decoder layers (transformers' "
                          f"base_model_tp_plan) and a small copy to derive one from would not run: {first}") from None
    dims = _Dims.of(tiny.config)
    derived: dict[tuple, tuple[Block, ...]] = {}  # one derivation per distinct layer
    plans, blocks = {}, {}
    for index, layer in model.layers.items():
        twin = tiny_layers[int(index)] if int(index) < len(tiny_layers) else None
        if twin is None or _signature(twin) != _signature(layer):
            raise ConfigError(f"{arch} declares no tensor-parallel plan for its decoder layers and layer {index} "
                              f"({type(layer).__name__}) differs in the small copy a plan derives from")
        sig = (_signature(layer), model.layer_kinds[int(index)])
        if sig not in derived:
            derived[sig] = tuple(_blocks(twin, calls[int(index)], dims))
        blocks[index] = derived[sig]
        plans[index] = {path: style for b in derived[sig] for path, style in b.styles().items()}
    if not any(plans.values()):
        raise ConfigError(f"{arch} declares no tensor-parallel plan for its decoder layers (transformers' "
                          "base_model_tp_plan) and none derives from its layers' projections: no module in a "
                          "layer projects the hidden states in and back out to its own output")
    return LayerPlans(plans, derived=True, blocks=blocks)
