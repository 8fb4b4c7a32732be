"""``model=hf``'s parallelize hook: TP/SP -> activation checkpointing -> compile -> FSDP.

Everything is found from the model's own structure: the decoder layers are the list
transformers built (checked against the architecture's ``_no_split_modules``), the
tensor-parallel plan is the model's ``base_model_tp_plan`` (or, where it declares none,
one derived from the layer's projections: ``titan_hf.tp_plan``) mapped onto torch's
styles (:func:`torch_style`). Activations between modules stay plain local tensors, as
transformers' attention expects (it reads head counts off the local shapes):

- without SP: hidden states replicated, column-wise projections give local heads /
  local MLP columns, row-wise ones all-reduce;
- with SP (``parallelism.sequence_parallel``): hidden states hold ``1/tp`` of the
  sequence; each attention / MLP all-gathers its input, its row-wise projection
  reduce-scatters, and every layer norm runs on its sequence shard with a replicated
  weight (gradient all-reduced by DTensor).

Per-head q/k norms (``replicated_with_grad_allreduce``) run on ``Shard(2)`` (heads)
DTensors with a replicated weight, so their gradient is summed over the TP ranks.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from titan_hf.context_parallel import use_cp_attention
from titan_hf.tp_plan import DERIVED, LayerPlans, tp_plans
from titan_hf.validate import expert_plan, validate
from titan_plugins.distributed.activation_checkpoint import apply_activation_checkpointing
from titan_plugins.distributed.compile import apply_compile
from titan_plugins.distributed.fsdp import apply_fsdp
from titan_plugins.errors import ConfigError

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from titan_hf.model import HFCausalLM
    from titan_plugins.distributed.parallel_dims import ParallelDims

__all__ = ["apply_ep", "apply_tp", "parallelize", "torch_style"]

_GATHERING = ("colwise", "colwise_gather_output")  # their parent module all-gathers its input under SP


def torch_style(style: str, *, sequence_parallel: bool) -> ParallelStyle:
    """transformers' TP style name -> torch's ``ParallelStyle`` (plain tensors out)."""
    out = Shard(1) if sequence_parallel else Replicate()
    styles = {
        "colwise": lambda: ColwiseParallel(),
        "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
        "rowwise": lambda: RowwiseParallel(output_layouts=out),
        "rowwise_split_input": lambda: RowwiseParallel(input_layouts=Replicate(), output_layouts=out),
        "replicated_with_grad_allreduce": lambda: SequenceParallel(sequence_dim=2, use_local_output=True),  # per-head norms
    }
    return styles[style]()


class GatherSequence(ParallelStyle):
    """Under SP a block's hidden states (``hidden_states=``, else its first argument, as
    the layer calls it) arrive as a sequence shard: all-gathered into a ``Replicate()``
    DTensor before it runs, as ``PrepareModuleInput`` does for a fixed call form."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        def gather(x):
            if not isinstance(x, DTensor):
                x = DTensor.from_local(x, device_mesh, (Shard(1),), run_check=False)
            return x.redistribute(device_mesh, (Replicate(),))

        def hook(_module, args, kwargs):
            if "hidden_states" in kwargs:
                return args, {**kwargs, "hidden_states": gather(kwargs["hidden_states"])}
            return (gather(args[0]), *args[1:]), kwargs

        module.register_forward_pre_hook(hook, with_kwargs=True)
        return module


def _norm_children(module: nn.Module) -> list[str]:
    return [name for name, child in module.named_children() if "Norm" in type(child).__name__]


def _plan_source(model: HFCausalLM, plans: LayerPlans) -> str:
    arch = model.config.architecture
    return f"{arch} declares no tensor-parallel plan; the {DERIVED}" if plans.derived else \
        f"{arch}'s base_model_tp_plan"


def _check_sequence_parallel(model: HFCausalLM, plans: LayerPlans, key: str) -> None:
    """Under SP a layer's other children see a sequence shard: one holding weights the
    plan does not gather for (an MoE block beside an attention-only plan) would sum
    nothing over the TP ranks, so its gradient would be one rank's; so would the
    layer's own parameters (a residual scale)."""
    layer = model.layers[key]
    gathered, norms = _gathered(_present(layer, plans.plans[key])), set(_norm_children(layer))
    own = next((n for n, _ in layer.named_parameters(recurse=False)), None)
    if own is not None:
        raise ConfigError(f"parallelism.sequence_parallel=true: {model.config.architecture}'s decoder layer holds "
                          f"its own parameter {own!r}, which would see a sequence shard; run with "
                          "parallelism.sequence_parallel=false")
    handed = next((w for b in plans.blocks.get(key, ()) for w in b.hands_out), None)
    if handed is not None:
        raise ConfigError(f"parallelism.sequence_parallel=true: {_plan_source(model, plans)} hands the layer "
                          f"its parameter {handed!r}, which the layer would use on a sequence shard; run with "
                          "parallelism.sequence_parallel=false")
    for name, child in layer.named_children():
        if name not in gathered and name not in norms and any(True for _ in child.parameters()):
            raise ConfigError(
                f"parallelism.sequence_parallel=true: {_plan_source(model, plans)} "
                f"leaves the layer's {name!r} ({type(child).__name__}) out; run with "
                "parallelism.sequence_parallel=false")


def _gathered(plan: dict[str, str]) -> set[str]:
    return {p.rpartition(".")[0] for p, s in plan.items() if s in _GATHERING}


def _present(layer: nn.Module, plan: dict[str, str]) -> dict[str, str]:
    """The entries of ``plan`` naming a module this layer has: a declared plan names a
    dense MLP's ``mlp.gate_proj`` that an MoE layer's ``mlp`` (Qwen3-MoE) lacks, which must
    not count as that block being gathered."""
    names = {n for n, _ in layer.named_modules()}
    return {p: s for p, s in plan.items() if p in names}


def check_sequence_parallel(model: HFCausalLM) -> None:
    """``_check_sequence_parallel`` on every decoder layer (a model on meta will do): the
    launcher refuses before any rank starts what ``apply_tp`` would refuse in each rank."""
    plans = tp_plans(model)
    for key in model.layers:
        _check_sequence_parallel(model, plans, key)


def _copy_output(_module: nn.Module, _args, output):
    return output.clone()


def _is_rank0() -> bool:
    import torch.distributed as dist

    return not dist.is_initialized() or dist.get_rank() == 0


def apply_tp(model: HFCausalLM, tp_mesh, *, sequence_parallel: bool, loss_parallel: bool) -> None:
    """The model's own plan (or the derived one) on each decoder layer, then embedding,
    norm and head."""
    sp = sequence_parallel
    plans = tp_plans(model)
    if plans.derived and _is_rank0():  # in the run's log: what was split, and how
        print(f"model=hf: {DERIVED}: {plans.summary()}", flush=True)
    for key, layer in model.layers.items():
        plan = plans.plans[key]
        layer_styles = {path: torch_style(style, sequence_parallel=sp) for path, style in plan.items()}
        if sp:
            _check_sequence_parallel(model, plans, key)
            for parent in sorted(_gathered(_present(layer, plan))):
                layer_styles[parent] = GatherSequence()
            for name in _norm_children(layer):
                layer_styles[name] = SequenceParallel(use_local_output=True)
        parallelize_module(layer, tp_mesh, layer_styles)
        for block in plans.blocks.get(key, ()):
            for path in block.modified:  # after the style's own hook: a copy the model may change
                layer.get_submodule(path).register_forward_hook(_copy_output)
    act = Shard(1) if sp else Replicate()
    root: dict[str, ParallelStyle] = {}
    if model.tok_embeddings is not None:
        root["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=act)
    if model.norm is not None and sp:
        # a Shard(1) DTensor out: the head (or the trainer's fused loss, which takes the
        # head's input) sees a sequence shard, not a whole replicated sequence
        root["norm"] = SequenceParallel(use_local_output=False)
    if model.output is not None:
        root["output"] = ColwiseParallel(input_layouts=act, output_layouts=Shard(-1) if loss_parallel else Replicate(),
                                         use_local_output=not loss_parallel)
    if root:
        parallelize_module(model, tp_mesh, root)
    if model.config.enable_weight_tying and model.tok_embeddings is not None and model.output is not None:
        model.output.weight = model.tok_embeddings.weight  # both Shard(0) on tp: re-tie
    model.seq_shards = tp_mesh.size() if sp else 1


def layers_expert_plan(layers: Mapping[str, nn.Module], plan: dict[str, str], who: str) -> dict[str, str]:
    """The per-layer ``plan`` made concrete (``layers.<key>.<path>``) for the layers that hold
    the experts module it dispatches to. Dense layers (the first k of DeepSeek-style models)
    are left as they are; a layer with experts but without a weight the plan names is refused."""
    dispatch = next(path for path, style in plan.items() if style == "ep_dispatch_experts")
    concrete: dict[str, str] = {}
    for key, layer in layers.items():
        present = {n for n, _ in layer.named_parameters()} | {n for n, _ in layer.named_modules()}
        if dispatch not in present:
            continue
        missing = sorted(path for path in plan if path not in present)
        if missing:
            raise ConfigError(f"{who}'s base_model_ep_plan names layers.{key}.{missing[0]}, which its layer {key} "
                              "does not have")
        concrete.update({f"layers.{key}.{path}": style for path, style in plan.items()})
    return concrete


def apply_ep(model: HFCausalLM, ep_mesh, tp_mesh) -> str:
    """transformers' own ``base_model_ep_plan`` on this stage's layers: expert weights
    ``Shard(0)`` (whole experts) on ``ep_mesh``, and the experts module's forward
    replaced by transformers' all-to-all token dispatch (``AllToAllEP`` in training;
    ``tp_mesh`` = the ranks holding the same batch). Returns the experts module's path
    inside a layer, for FSDP."""
    from transformers.distributed.expert_parallel import apply_expert_parallelism

    plan = expert_plan(model.hf_config)
    concrete = layers_expert_plan(model.layers, plan, f"parallelism.ep={ep_mesh.size()}: {model.config.architecture}")
    # parameters first: sharding them sets the module's local expert count the dispatcher reads
    params = dict(model.named_parameters())
    ordered = dict(sorted(concrete.items(), key=lambda kv: kv[0] not in params))
    apply_expert_parallelism(model, ep_mesh, tp_mesh, ordered)
    return next(path for path, style in plan.items() if style == "ep_dispatch_experts")


def _swap_in_local(module: nn.Module, _args) -> None:
    module._titan_dtensor_params = dict(module._parameters)
    module._parameters.update({n: p.to_local() for n, p in module._titan_dtensor_params.items()
                               if n in module._titan_replicated})


def _swap_back(module: nn.Module, _args, _output) -> None:
    module._parameters.update(module._titan_dtensor_params)


def replicate_plain_params(model: nn.Module, tp_mesh) -> None:
    """Without FSDP one fused AdamW call steps every parameter, and it refuses a mix of
    DTensors and plain tensors: the parameters the TP plan left plain (norms without SP,
    an MoE router) become ``Replicate()`` DTensors on ``tp``, and their module computes on
    the local tensors. Their inputs are replicated over ``tp`` there, so each rank's
    gradient is already the whole one (no reduction needed)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    for module in model.modules():
        plain = [n for n, p in module.named_parameters(recurse=False) if not isinstance(p, DTensor)]
        if not plain:
            continue
        for name in plain:
            p = module._parameters[name]
            module._parameters[name] = nn.Parameter(distribute_tensor(p.data, tp_mesh, [Replicate()], src_data_rank=None),
                                                    requires_grad=p.requires_grad)
        module._titan_replicated = frozenset(plain)
        module.register_forward_pre_hook(_swap_in_local)
        module.register_forward_hook(_swap_back, always_call=True)


def _check_layers(model: HFCausalLM) -> None:
    """FSDP/AC/compile units are the decoder layers: they must be what the architecture
    itself declares unsplittable."""
    allowed = model.no_split_modules
    for key, layer in model.layers.items():
        name = type(layer).__name__
        if allowed and name not in allowed:
            raise ConfigError(f"model.hf: {model.config.architecture} layer {key} is a {name}, not one of its "
                              f"_no_split_modules ({', '.join(sorted(allowed))}); model=hf cannot wrap it per layer")


def parallelize(model: HFCausalLM, parallel_dims: ParallelDims, job_config: DictConfig) -> nn.Module:
    validate(model.config, parallel_dims)
    _check_layers(model)
    par = job_config.parallelism
    if getattr(parallel_dims, "cp", 1) > 1:  # keys and values gathered over the cp group
        use_cp_attention(model)
    if parallel_dims.tp_enabled:
        apply_tp(model, parallel_dims.mesh("tp"), sequence_parallel=bool(par.sequence_parallel),
                 loss_parallel=bool(par.loss_parallel))
    experts = None
    if parallel_dims.ep_enabled:
        experts = apply_ep(model, parallel_dims.mesh("ep"), parallel_dims.mesh("tp"))
    if parallel_dims.tp_enabled and parallel_dims.dp_shard * parallel_dims.dp_replicate == 1:
        replicate_plain_params(model, parallel_dims.mesh("tp"))  # FSDP would make them DTensors itself
    apply_activation_checkpointing(model, job_config, layers_attr="layers")
    apply_compile(model, job_config, layers_attr="layers")
    # Tied embeddings stay one FSDP parameter: apply_fsdp keeps them in the root unit.
    # Under EP the experts are their own unit on the expert_fsdp mesh.
    apply_fsdp(model, parallel_dims, job_config, layers_attr="layers", experts_attr=experts)
    return model
