"""Tensor / sequence parallelism with DTensor through the whole TP region.

The first-party models keep activations as DTensors from the embedding to the
output projection (``use_local_output=False`` everywhere), so every op in between
sees the real layout and DTensor inserts the collectives. Two things are handed
plain local tensors on purpose: the attention kernel (SDPA has no DTensor
strategy on CPU and flex attention has none at all; see ``LocalAttention``) and
the MoE layer (its own boundary contract, ``titan_plugins.distributed.expert_parallel``).

Activation layouts inside the region, for ``[batch, seq, dim]`` hidden states:

    sequence_parallel=True     Shard(1) between blocks, Replicate inside
                               attention / MLP, norms run sequence-sharded
    sequence_parallel=False    Replicate everywhere; norm weights are replicated
                               DTensors (``ReplicateParallel``)

A typical decoder plan, written by a model's ``parallelize.py`` from the plan
pieces below (names are the shared components' ``attention``/``feed_forward``/
``attention_norm``/``ffn_norm``; nothing here knows any model)::

    def block_plan(block, sp):
        # attention(x, rope_cache, mask): the cache replicated per call, the mask plain
        attention = gqa_attention_plan(sp, Replicate(), None)
        return decoder_block_plan(sp, attention, feed_forward=not block.moe_enabled)

    apply_decoder_tp(model, tp_mesh, block_plan, sequence_parallel=sp, loss_parallel=lp)

``apply_decoder_tp`` is ``root_plan`` (embedding, final norm, output), one plan per
owned block, then ``stage_boundary_plan``, re-tying tied embeddings on the way.

Rotary caches stay plain (non-persistent) buffers; they become replicated DTensors
only per call, either as a ``Replicate()`` entry of ``gather_input`` (the cache is
a positional input of the attention module) or with ``replicate_like`` inside a
forward. Sequence lengths that TP does not divide are fine: DTensor shards the
sequence unevenly (``torch.chunk`` sizes) and pads its collectives itself.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import (
    DTensor,
    Placement,
    Replicate,
    Shard,
    distribute_module,
    distribute_tensor,
)
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.distributed.tensor.parallel.style import ParallelStyle

__all__ = [
    "AdapterAware",
    "EmbeddingParallel",
    "LocalAttention",
    "ReplicateParallel",
    "StageBoundary",
    "activation_layout",
    "apply_decoder_tp",
    "apply_tp_plan",
    "colwise",
    "decoder_block_plan",
    "gather_input",
    "gqa_attention_plan",
    "keep_grad_layout",
    "norm_style",
    "owned_blocks",
    "replicate_like",
    "replicate_on",
    "root_plan",
    "rowwise",
    "stage_boundary_plan",
    "swiglu_plan",
]


# --------------------------------------------------------------------- applying
def _owned(module: nn.Module, path: str) -> bool:
    """Whether ``path`` (dotted, no wildcards) names a module that exists here."""
    try:
        module.get_submodule(path)
    except AttributeError:  # a None attribute (pipeline stage) or no such child
        return False
    return True


def apply_tp_plan(
    module: nn.Module | None,
    tp_mesh: DeviceMesh,
    plan: Mapping[str, ParallelStyle] | ParallelStyle,
) -> nn.Module | None:
    """``parallelize_module`` that skips what this pipeline stage does not own.

    ``module=None`` (a block or root module absent on this stage) is a no-op; plan
    entries whose dotted key resolves to ``None`` or to no module at all (e.g.
    ``tok_embeddings`` on a later stage, ``output`` before the last) are dropped.
    Keys with ``*`` wildcards are passed through to ``parallelize_module``.
    A bare ``ParallelStyle`` applies to ``module`` itself. Returns ``module``.
    """
    if module is None:
        return None
    if isinstance(plan, ParallelStyle):
        return parallelize_module(module, tp_mesh, AdapterAware.wrap(plan))
    kept = {key: AdapterAware.wrap(style) for key, style in plan.items() if "*" in key or _owned(module, key)}
    if kept:
        parallelize_module(module, tp_mesh, kept)
    return module


class AdapterAware(ParallelStyle):
    """A column- or row-wise style that also places a LoRA adapter pair like its base
    layer (``apply_tp_plan`` wraps every such style; nothing for a plugin to do).

    With ``W x`` column-wise (``W`` ``Shard(0)``), ``A`` is replicated and ``B``
    ``Shard(0)``: ``B (A x)`` comes out ``Shard(-1)`` like ``W x``. Row-wise (``W``
    ``Shard(1)``, input ``Shard(-1)``), ``A`` is ``Shard(1)`` and ``B`` replicated:
    ``B (A x)`` is ``Partial`` like ``W x`` and rides on the base layer's own
    reduction. No collective moves a base weight; the adapters' gradients reduce
    only rank-sized activations. Other styles (e.g. ``ReplicateParallel``) replicate
    the adapters with the rest of the module.
    """

    def __init__(self, inner: ParallelStyle) -> None:
        super().__init__()
        self.inner = inner

    @classmethod
    def wrap(cls, style: ParallelStyle) -> ParallelStyle:
        return cls(style) if isinstance(style, ColwiseParallel | RowwiseParallel) else style

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        self.inner.src_data_rank = getattr(self, "src_data_rank", 0)
        if "lora_A" not in module._modules:
            return self.inner._apply(module, device_mesh)
        children = dict(module._modules)  # the adapters and their dropout
        module._modules.clear()
        # QLoRA (peft/qlora.py): the 4-bit base weight is a frozen buffer kept whole on every
        # rank; the style keeps its input/output layouts and shards only the adapters.
        whole_base = "weight" in module._buffers
        if whole_base:
            self.inner._partition_linear_fn = lambda *_args: None
        try:
            module = self.inner._apply(module, device_mesh)  # the base layer alone
        finally:
            module._modules.update(children)
            if whole_base:
                del self.inner._partition_linear_fn
        pair = {k: children[k] for k in ("lora_A", "lora_B")}
        rowwise_base = isinstance(self.inner, RowwiseParallel)
        layouts = {"lora_A": Shard(1) if rowwise_base else Replicate(),
                   "lora_B": Replicate() if rowwise_base else Shard(0)}
        for key, adapter in pair.items():
            param = adapter.weight
            adapter.weight = nn.Parameter(
                distribute_tensor(param, device_mesh, [layouts[key]], src_data_rank=None),
                requires_grad=param.requires_grad,
            )
        return module


def owned_blocks(layers: nn.ModuleDict | None) -> Iterator[nn.Module]:
    """The blocks of a (possibly pipeline-split) ``ModuleDict`` that exist here."""
    if layers is None:
        return iter(())
    return (block for block in layers.values() if block is not None)


# ---------------------------------------------------------------------- layouts
def activation_layout(sequence_parallel: bool) -> Placement:
    """Layout of ``[batch, seq, dim]`` hidden states between blocks."""
    return Shard(1) if sequence_parallel else Replicate()


def colwise() -> ColwiseParallel:
    """Column-wise linear (q/k/v, w1/w3): Replicate in, ``Shard(-1)`` DTensor out."""
    return ColwiseParallel(use_local_output=False)


def rowwise(sequence_parallel: bool) -> RowwiseParallel:
    """Row-wise linear (wo, w2): ``Shard(-1)`` in, the activation layout out (a
    reduce-scatter under SP, an all-reduce otherwise), DTensor out."""
    return RowwiseParallel(output_layouts=activation_layout(sequence_parallel), use_local_output=False)


def norm_style(sequence_parallel: bool, sequence_dim: int = 1) -> ParallelStyle:
    """Style for a norm over the last dim of hidden states.

    Under SP the norm runs on ``Shard(sequence_dim)`` input; without SP its weight
    is replicated and the input stays ``Replicate``. For per-head q/k norms on
    ``[batch, seq, heads, head_dim]`` use ``SequenceParallel(sequence_dim=2,
    use_local_output=False)`` (heads are sharded whatever SP says).
    """
    if sequence_parallel:
        return SequenceParallel(sequence_dim=sequence_dim, use_local_output=False)
    return ReplicateParallel()


def gather_input(sequence_parallel: bool, *rest: Placement | None) -> PrepareModuleInput:
    """Input style for an attention or MLP module: its first positional input (the
    hidden states, in the activation layout) becomes a ``Replicate`` DTensor
    (an all-gather under SP).

    ``rest`` gives one entry per further positional input: a placement wraps a
    plain tensor as a DTensor of that layout per call (``Replicate()`` for a rotary
    cache), ``None`` passes it through untouched (masks, positions). The number of
    entries must match the positional arguments the module is called with.
    """
    layout = activation_layout(sequence_parallel)
    return PrepareModuleInput(
        input_layouts=(layout, *rest),
        desired_input_layouts=(Replicate(), *rest),
        use_local_output=False,
    )


def root_plan(
    *,
    sequence_parallel: bool,
    loss_parallel: bool,
    embedding: str = "tok_embeddings",
    norm: str | None = "norm",
    output: str = "output",
) -> dict[str, ParallelStyle]:
    """Plan for the embedding, final norm and output projection of a decoder.

    - embedding: row-wise over the vocabulary; token ids come in plain and
      replicated, hidden states leave as a DTensor in the activation layout.
    - norm: ``norm_style(sequence_parallel)``.
    - output: column-wise over the vocabulary. Under ``loss_parallel`` the logits
      stay a ``Shard(-1)`` DTensor (``use_local_output=False``; compute the loss
      inside ``torch.distributed.tensor.parallel.loss_parallel()``); otherwise they
      are gathered into a plain, replicated tensor.

    Entries for modules a stage lacks are dropped by ``apply_tp_plan``. Tied
    embeddings: both weights end up ``Shard(0)`` on the same mesh, so re-tie them
    (``output.weight = embedding.weight``) right after applying this plan.
    """
    layout = activation_layout(sequence_parallel)
    plan: dict[str, ParallelStyle] = {
        embedding: EmbeddingParallel(output_layout=layout),
        output: ColwiseParallel(
            input_layouts=layout,
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        ),
    }
    if norm is not None:
        plan[norm] = norm_style(sequence_parallel)
    return plan


# ------------------------------------------------------------- custom styles
class _KeepGradLayout(torch.autograd.Function):
    """Identity; backward redistributes the gradient to the forward placements."""

    @staticmethod
    def forward(ctx, x):
        ctx.placements = x.placements
        # A copy, not a view: FSDP2 warns (once per rank) about modules returning
        # views, and this wraps the output of an FSDP-wrapped embedding.
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        if isinstance(grad, DTensor) and grad.placements != ctx.placements:
            grad = grad.redistribute(placements=ctx.placements)
        return grad


def keep_grad_layout(x: torch.Tensor) -> torch.Tensor:
    """``x`` unchanged; its gradient arrives in ``x``'s own placements.

    A replicated activation consumed by several DTensor ops can receive a
    ``Partial`` gradient; ops whose backward cannot take one (the vocab-sharded
    embedding's ``MaskPartial``) need it reduced first."""
    return _KeepGradLayout.apply(x) if isinstance(x, DTensor) else x


class EmbeddingParallel(RowwiseParallel):
    """Vocab-sharded embedding (row-wise): token ids in as plain replicated
    tensors, hidden states out as a DTensor in ``output_layout``. Its output's
    gradient is brought back to ``output_layout`` before the embedding's own
    backward (see ``keep_grad_layout``)."""

    def __init__(self, output_layout: Placement):
        super().__init__(input_layouts=Replicate(), output_layouts=output_layout, use_local_output=False)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module = super()._apply(module, device_mesh)
        module.register_forward_hook(lambda mod, inputs, output: keep_grad_layout(output))
        return module


class ReplicateParallel(ParallelStyle):
    """Replicate a module's parameters on the TP mesh and run it on DTensors.

    For modules inside the TP region that are not sharded (norms without SP,
    small gates). Plain tensor inputs are taken as ``input_layout`` (default
    ``Replicate``) and redistributed to ``desired_input_layout`` (default: the
    same); outputs are DTensors unless ``use_local_output``.
    """

    def __init__(
        self,
        *,
        input_layout: Placement | None = None,
        desired_input_layout: Placement | None = None,
        use_local_output: bool = False,
    ):
        super().__init__()
        self.input_layout = input_layout or Replicate()
        self.desired_input_layout = desired_input_layout or self.input_layout
        self.use_local_output = use_local_output

    def _prepare_input(self, module, inputs, mesh):
        out = []
        for inp in inputs:
            if isinstance(inp, torch.Tensor) and not isinstance(inp, DTensor):
                inp = DTensor.from_local(inp, mesh, (self.input_layout,), run_check=False)
            if isinstance(inp, DTensor) and inp.placements != (self.desired_input_layout,):
                inp = inp.redistribute(placements=(self.desired_input_layout,))
            out.append(inp)
        return tuple(out)

    def _prepare_output(self, module, outputs, mesh):
        if self.use_local_output and isinstance(outputs, DTensor):
            return outputs.to_local()
        return outputs

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(
            module,
            device_mesh,
            partition_fn=None,  # parameters replicated
            input_fn=lambda mod, inputs, mesh: self._prepare_input(mod, inputs, mesh),
            output_fn=lambda mod, outputs, mesh: self._prepare_output(mod, outputs, mesh),
        )


class LocalAttention(ParallelStyle):
    """Hand an attention kernel (SDPA, flex attention) plain local tensors.

    Apply it to the module that wraps the kernel call, ``kernel(q, k, v, ...)``
    with ``[batch, heads, seq, head_dim]`` inputs. Before the call every DTensor
    argument (positional or keyword) is replaced by its local shard: with heads
    sharded column-wise each rank attends over its own heads, and GQA's
    query-to-kv grouping is preserved because TP divides both head counts. After
    the call each tensor output becomes a DTensor again with the inputs'
    placements (``Shard(1)``: heads), so the region continues on DTensors. Inputs
    that are all plain leave the module untouched (e.g. TP on another stage).
    Masks (``BlockMask``) and other non-DTensor arguments pass through.

    The kernel module's own parameters are per query head (attention sinks,
    ``components.gqa.SinkKernel``): they are sharded like the heads, ``Shard(0)``,
    and the kernel reads its local part (``to_local()``).
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for name, param in list(module.named_parameters(recurse=False)):
            sharded = distribute_tensor(param, device_mesh, [Shard(0)], src_data_rank=getattr(self, "src_data_rank", 0))
            module.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))
        state: dict[str, Any] = {}

        def unwrap(value):
            if isinstance(value, DTensor):
                placements = value.placements
                seen = state.setdefault("placements", placements)
                if seen != placements:
                    raise ValueError(
                        f"LocalAttention: inputs have different placements ({seen} vs {placements}); "
                        "q, k and v must be sharded alike"
                    )
                state["mesh"] = value.device_mesh
                return value.to_local()
            return value

        def pre_hook(mod, args, kwargs):
            state.clear()
            return tuple(unwrap(a) for a in args), {k: unwrap(v) for k, v in kwargs.items()}

        def wrap(value):
            if isinstance(value, torch.Tensor) and not isinstance(value, DTensor):
                return DTensor.from_local(value, state["mesh"], state["placements"], run_check=False)
            return value

        def post_hook(mod, args, kwargs, output):
            if "mesh" not in state:
                return output
            if isinstance(output, tuple):
                return tuple(wrap(o) for o in output)
            return wrap(output)

        module.register_forward_pre_hook(pre_hook, with_kwargs=True)
        module.register_forward_hook(post_hook, with_kwargs=True)
        return module


class StageBoundary(ParallelStyle):
    """Hidden states crossing a pipeline-stage boundary as plain tensors.

    Pipeline stages send and receive plain tensors: the local shard of the
    activation layout (``[batch, seq/tp, dim]`` under SP, the full sequence
    otherwise). Applied to the first block a stage owns (when the stage has no
    embedding), ``inputs=True`` wraps the first positional input as a DTensor in
    ``layout``; applied to the last block (when the stage has no output
    projection), ``outputs=True`` returns the DTensor output's local shard in
    ``layout``. A DTensor input is only redistributed to ``layout``. Uneven
    ``Shard`` layouts are supported (the global length costs one scalar all-reduce).
    """

    def __init__(self, layout: Placement, *, inputs: bool = False, outputs: bool = False):
        super().__init__()
        self.layout = layout
        self.inputs = inputs
        self.outputs = outputs

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        layout = (self.layout,)

        def pre_hook(mod, args):
            if not args:
                return None
            x = args[0]
            if isinstance(x, DTensor):
                x = x if x.placements == layout else x.redistribute(placements=layout)
            else:
                x = _from_local_shard(x, device_mesh, self.layout)
            return (x, *args[1:])

        def post_hook(mod, args, output):
            if not isinstance(output, DTensor):
                return output
            if output.placements != layout:
                output = output.redistribute(placements=layout)
            return output.to_local()

        if self.inputs:
            module.register_forward_pre_hook(pre_hook)
        if self.outputs:
            module.register_forward_hook(post_hook)
        return module


def _from_local_shard(x: torch.Tensor, mesh: DeviceMesh, layout: Placement) -> DTensor:
    """Wrap a received local shard. A ``Shard(d)`` layout may be uneven (sequence not
    divisible by TP), so the global size along ``d`` is summed over the mesh (one
    scalar all-reduce) instead of assumed to be ``local * mesh size``."""
    if not isinstance(layout, Shard) or mesh.size() == 1:
        return DTensor.from_local(x, mesh, (layout,), run_check=False)
    dim = layout.dim % x.ndim
    size = torch.tensor([x.shape[dim]], dtype=torch.int64, device=x.device)
    torch.distributed.all_reduce(size, group=mesh.get_group())
    shape = list(x.shape)
    shape[dim] = int(size.item())
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(x, mesh, (layout,), run_check=False, shape=torch.Size(shape), stride=stride)


def stage_boundary_plan(
    model: nn.Module,
    *,
    sequence_parallel: bool,
    layers_attr: str = "layers",
    embedding: str = "tok_embeddings",
    output: str = "output",
) -> dict[str, ParallelStyle]:
    """``StageBoundary`` entries for a pipeline stage (empty without PP).

    A stage without ``embedding`` receives plain hidden states: its first block
    gets ``StageBoundary(inputs=True)``. A stage without ``output`` must return
    plain hidden states: its last block gets ``StageBoundary(outputs=True)``.
    Apply it with ``apply_tp_plan(model, tp_mesh, plan)`` after the block plans.
    """
    layers = getattr(model, layers_attr, None)
    keys = [k for k, b in layers.items() if b is not None] if layers is not None else []
    if not keys:
        return {}
    layout = activation_layout(sequence_parallel)
    first_in = getattr(model, embedding, None) is None
    last_out = getattr(model, output, None) is None
    plan: dict[str, ParallelStyle] = {}
    if len(keys) == 1 and first_in and last_out:
        plan[f"{layers_attr}.{keys[0]}"] = StageBoundary(layout, inputs=True, outputs=True)
        return plan
    if first_in:
        plan[f"{layers_attr}.{keys[0]}"] = StageBoundary(layout, inputs=True)
    if last_out:
        plan[f"{layers_attr}.{keys[-1]}"] = StageBoundary(layout, outputs=True)
    return plan


# ------------------------------------------------------------ decoder plans
def gqa_attention_plan(
    sequence_parallel: bool, *rest: Placement | None, prefix: str = "attention"
) -> dict[str, ParallelStyle]:
    """Grouped-query attention (``titan_plugins.components.attention.GQAttention``
    names): the module's input gathered (``rest``: its further positional inputs, see
    ``gather_input``), ``wq``/``wk``/``wv`` column-wise (heads sharded), per-head
    ``q_norm``/``k_norm`` sharded on heads, the kernel on local heads, ``wo`` row-wise.
    Entries for modules a model lacks (no qk-norm) are dropped by ``apply_tp_plan``."""
    heads = SequenceParallel(sequence_dim=2, use_local_output=False)
    return {
        prefix: gather_input(sequence_parallel, *rest),
        **{f"{prefix}.{name}": colwise() for name in ("wq", "wk", "wv")},
        f"{prefix}.q_norm": heads,
        f"{prefix}.k_norm": heads,
        f"{prefix}.inner_attention": LocalAttention(),
        f"{prefix}.wo": rowwise(sequence_parallel),
    }


def swiglu_plan(sequence_parallel: bool, prefix: str = "feed_forward") -> dict[str, ParallelStyle]:
    """SwiGLU (``components.feed_forward.FeedForward``): input gathered, ``w1``/``w3``
    column-wise, ``w2`` row-wise back to the activation layout."""
    return {
        prefix: gather_input(sequence_parallel),
        f"{prefix}.w1": colwise(),
        f"{prefix}.w3": colwise(),
        f"{prefix}.w2": rowwise(sequence_parallel),
    }


def decoder_block_plan(
    sequence_parallel: bool, attention: Mapping[str, ParallelStyle], *, feed_forward: bool
) -> dict[str, ParallelStyle]:
    """A pre-norm decoder block: ``attention_norm``, the ``attention`` plan given,
    ``ffn_norm`` and, when ``feed_forward`` (a dense block; an MoE owns its boundary,
    see ``titan_plugins.distributed.expert_parallel``), ``swiglu_plan``."""
    sp = sequence_parallel
    plan = {"attention_norm": norm_style(sp), **attention, "ffn_norm": norm_style(sp)}
    return plan | swiglu_plan(sp) if feed_forward else plan


def apply_decoder_tp(
    model: nn.Module,
    tp_mesh: DeviceMesh,
    block_plan: Callable[[nn.Module, bool], Mapping[str, ParallelStyle]],
    *,
    sequence_parallel: bool,
    loss_parallel: bool,
    output: str = "output",
) -> None:
    """TP for a decoder (this pipeline stage's part of it): ``root_plan``, then
    ``block_plan(block, sequence_parallel)`` on every owned block of ``model.layers``,
    then ``stage_boundary_plan``. Tied embeddings (the output weight *is* the
    embedding weight) are both ``Shard(0)`` on the mesh and re-tied after the root plan."""
    sp = sequence_parallel
    embedding, head = getattr(model, "tok_embeddings", None), getattr(model, output, None)
    tied = embedding is not None and head is not None and head.weight is embedding.weight
    apply_tp_plan(model, tp_mesh, root_plan(sequence_parallel=sp, loss_parallel=loss_parallel, output=output))
    if tied:
        head.weight = embedding.weight
    for block in owned_blocks(model.layers):
        apply_tp_plan(block, tp_mesh, block_plan(block, sp))
    apply_tp_plan(model, tp_mesh, stage_boundary_plan(model, sequence_parallel=sp, output=output))


# ------------------------------------------------------------ per-call helpers
def replicate_on(tensor: torch.Tensor, mesh: DeviceMesh) -> DTensor:
    """A plain tensor (same on every rank, e.g. a rotary cache) as a replicated
    DTensor on ``mesh``, for this call only (no copy, no communication)."""
    return DTensor.from_local(tensor, mesh, [Replicate()] * mesh.ndim, run_check=False)


def replicate_like(tensor: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``tensor`` as a replicated DTensor on ``like``'s mesh if ``like`` is a
    DTensor, else ``tensor`` unchanged: lets a forward mix a plain buffer into
    DTensor math without knowing whether TP is on."""
    if isinstance(like, DTensor) and not isinstance(tensor, DTensor):
        return replicate_on(tensor, like.device_mesh)
    return tensor
