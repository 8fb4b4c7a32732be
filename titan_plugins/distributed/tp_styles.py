"""The tensor-parallel styles and per-call helpers the plans of
``titan_plugins.distributed.tensor_parallel`` are made of: what one module (and the
tensors crossing it) becomes on the TP mesh.

- ``AdapterAware``: a column-/row-wise style that places a LoRA pair like its base layer.
- ``EmbeddingParallel``: the vocab-sharded embedding (with ``keep_grad_layout``).
- ``ReplicateParallel``: an unsharded module run on replicated DTensors.
- ``LocalAttention``: an attention kernel handed plain local heads.
- ``StageBoundary``: hidden states crossing a pipeline-stage boundary as plain tensors.
- ``replicate_on`` / ``replicate_like``: a plain buffer as a replicated DTensor, per call.

Every name here is also importable from ``titan_plugins.distributed.tensor_parallel``.
"""

from __future__ import annotations

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
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
from torch.distributed.tensor.parallel.style import ParallelStyle

__all__ = [
    "AdapterAware",
    "EmbeddingParallel",
    "LocalAttention",
    "ReplicateParallel",
    "StageBoundary",
    "keep_grad_layout",
    "replicate_like",
    "replicate_on",
]


# ------------------------------------------------------------- custom styles
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
