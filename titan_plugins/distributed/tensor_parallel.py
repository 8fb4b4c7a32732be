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

This module builds and applies the plans; the styles they are made of (and the per-call
helpers ``replicate_on``/``replicate_like``) are ``tp_styles``'s, re-exported here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Placement, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.distributed.tensor.parallel.style import ParallelStyle

from titan_plugins.distributed.tp_styles import (
    AdapterAware,
    EmbeddingParallel,
    LocalAttention,
    ReplicateParallel,
    StageBoundary,
    keep_grad_layout,
    replicate_like,
    replicate_on,
)

__all__ = [  # the plans, and the styles of tp_styles they are made of
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
