"""The model lifecycle: build on meta -> (PP split) -> parallelize -> ``to_empty``
-> ``init_weights(buffer_device)``; then pipeline stages and schedule under PP.

Plugins are called once per model part (one pipeline stage each under PP).
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from titan_plugins.components.compute_dtype import unsharded_compute_dtype
from titan_plugins.config.hydra_glue import model_config
from titan_plugins.distributed.float8 import convert_float8
from titan_plugins.distributed.fsdp import to_torch_dtype
from titan_plugins.errors import ConfigError
from titan_plugins.loss.fused import defer_heads
from titan_plugins.peft.lora import (
    adapter_parameters,
    apply_lora,
    freeze_base,
    init_adapters,
    lora_enabled,
)
from titan_plugins.peft.qlora import apply_qlora, base_aside, check_qlora, qlora_enabled, shard_base
from titan_plugins.spec import ModelSpec

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from titan_plugins.distributed.parallel_dims import ParallelDims
    from titan_plugins.plugins import TitanPluginManager

__all__ = ["ModelParts", "base_from_file", "build_meta_model", "build_model_parts", "materialize", "parallelized_parts"]


@dataclass
class ModelParts:
    """What the trainer trains: ``parts`` (one module, or this rank's pipeline
    stages), and under PP the ``schedule`` with first/last-stage flags."""

    parts: list[nn.Module]
    stages: list[Any] = field(default_factory=list)
    schedule: Any = None
    has_first: bool = True
    has_last: bool = True

    @property
    def pp(self) -> bool:
        return self.schedule is not None

    def parameters(self):
        for part in self.parts:
            yield from part.parameters()


def build_meta_model(spec: ModelSpec, job: DictConfig) -> nn.Module:
    """The whole model on the meta device, with the compute dtype set if asked."""
    build = spec.load("build")
    config = model_config(job.model, spec)
    with torch.device("meta"):
        model = build(config)
    compute = job.precision.get("compute_dtype") if hasattr(job.precision, "get") else job.precision.compute_dtype
    if compute is not None:
        setter = getattr(model, "set_compute_dtype", None)
        if setter is None:
            raise ConfigError(
                f"precision.compute_dtype={getattr(compute, 'value', compute)}: model {spec.name!r} "
                "does not implement set_compute_dtype"
            )
        setter(to_torch_dtype(compute))
    return model


def apply_peft(model: nn.Module, spec: ModelSpec, job: DictConfig) -> list[str]:
    """``peft=lora``: adapters on the matched ``nn.Linear`` modules, the rest frozen
    (titan_plugins/peft); returns the adapted modules' names (none without LoRA)."""
    if not lora_enabled(job):
        return []
    if job.precision.get("float8") is not None:
        raise ConfigError(
            f"peft.method=lora: not with precision.float8={getattr(job.precision.float8, 'value', job.precision.float8)} "
            "(float8 linears would drop the adapters); choose precision=bf16_mixed or fp32"
        )
    info = spec.pipeline
    edge = (info.first_stage_modules + info.last_stage_modules) if info else ("tok_embeddings", "norm", "output")
    if qlora_enabled(job):  # the same adapters over a 4-bit base (titan_plugins/peft/qlora.py)
        check_qlora(job)
        return apply_qlora(model, job.peft, exclude=tuple(edge))
    return apply_lora(model, job.peft, exclude=tuple(edge))


def _nf4_shards(parallel_dims: ParallelDims) -> int:
    """How many ranks share the QLoRA base: FSDP's 1-D ``dp_shard`` mesh; 1 (replicated)
    under TP, whose plans would distribute an NF4 parameter, and under HSDP."""
    if parallel_dims.tp_enabled or parallel_dims.dp_replicate > 1:
        return 1
    return parallel_dims.dp_shard


def base_from_file(job: DictConfig) -> bool:
    """Whether the run loads its base weights (``model.hf``, ``checkpoint.init_from``)
    after the build: QLoRA then quantizes them as they are read."""
    return bool(job.model.get("hf") or job.checkpoint.get("init_from"))


def materialize(part: nn.Module, job: DictConfig, device: torch.device, *, init: bool = True,
                base_later: bool = False, seed: int | None = None) -> None:
    """``to_empty``, the seeded ``init_weights`` and adapters' init (``seed``, default
    ``training.seed``), the cast to ``precision.weight_dtype``; QLoRA's base weights are
    kept out of all three (``base_aside``): on meta for the loader with ``base_later``,
    else quantized here."""
    weight_dtype = to_torch_dtype(job.precision.weight_dtype)
    seed = int(job.training.seed if seed is None else seed)
    qlora = qlora_enabled(job)
    with base_aside(part, device, weight_dtype, filled_later=base_later) if qlora else nullcontext() as aside:
        part.to_empty(device=device)
        if init:
            # Same seed on every rank: replicated parameters start equal.
            torch.manual_seed(seed)
            with torch.no_grad(), aside.for_init() if qlora else nullcontext():
                part.init_weights(buffer_device=device)
            init_adapters(part, seed)
        if weight_dtype != torch.float32:
            # Real floating tensors only: Module.to(dtype) would also turn a complex
            # freqs_cis into a real tensor and drop its imaginary part. LoRA adapters
            # stay fp32 (master weights of what trains) under a bf16 frozen base.
            keep = {id(p) for p in adapter_parameters(part)}
            part._apply(lambda t, keep=keep: t.to(weight_dtype) if t.is_floating_point() and id(t) not in keep else t)
    part.train()


def parallelized_parts(
    spec: ModelSpec, job: DictConfig, parallel_dims: ParallelDims, pm: TitanPluginManager
) -> list[tuple[int, nn.Module]]:
    """Build on meta, split for this pp rank, then the plugin's ``parallelize`` and the
    ``titan_after_parallelize`` hook per part: ``[(stage index, part)]``, still on meta.

    Shared by real runs (which then materialize) and plan mode (which does not).
    """
    model = build_meta_model(spec, job)
    implied = unsharded_compute_dtype(job.precision, parallel_dims)  # bf16_mixed on one rank
    if implied is not None and hasattr(model, "set_compute_dtype"):
        model.set_compute_dtype(implied)
    apply_peft(model, spec, job)  # model transforms: after build, before PP split and parallelize
    if qlora_enabled(job):  # the 4-bit base sharded by FSDP where it can be (peft/qlora.py)
        shard_base(model, _nf4_shards(parallel_dims))
    if parallel_dims.pp_enabled:
        from titan_plugins.distributed import pipeline

        if spec.pipeline is None:
            raise ConfigError(f"model {spec.name!r} does not support pipeline parallelism (parallelism.pp)")
        pp_rank = parallel_dims.mesh("pp").get_local_rank()
        split = pipeline.split_model(model, spec.pipeline, pp_rank, job.parallelism)
        del model
    else:
        split = [(0, model)]

    parallelize = spec.load("parallelize")
    out = []
    for stage, part in split:
        part = convert_float8(part, job, parallel_dims)  # precision.float8: torchao, before TP/FSDP
        result = parallelize(part, parallel_dims, job)
        part = result if isinstance(result, nn.Module) else part
        if pm is not None:
            hooked = pm.hook.titan_after_parallelize(model=part, parallel_dims=parallel_dims, job_config=job)
            part = hooked if isinstance(hooked, nn.Module) else part
        if lora_enabled(job):
            freeze_base(part)  # TP styles re-create replicated parameters as trainable
        out.append((stage, part))
    return out


def build_model_parts(
    spec: ModelSpec,
    job: DictConfig,
    parallel_dims: ParallelDims,
    device: torch.device,
    pm: TitanPluginManager,
    loss_fn: Any = None,
    *,
    init: bool = True,
    fused_loss: bool = True,
) -> ModelParts:
    """Build, split, parallelize, materialize and initialise this rank's model parts.

    ``fused_loss``: the part holding the head returns hidden states for the losses of
    ``loss/token_loss.py`` to project in chunks (``loss/fused.py``), unless
    ``training.loss_chunk_size=0``; ``False`` where a caller wants the logits themselves."""
    split = parallelized_parts(spec, job, parallel_dims, pm)
    parts = [part for _, part in split]

    later = base_from_file(job)  # QLoRA: the base is quantized as the trainer loads it
    for part in parts:
        materialize(part, job, device, init=init, base_later=later)

    if fused_loss:  # after to_empty/init/dtype casts: the head's class swap comes last
        defer_heads(parts, spec, job, parallel_dims)

    out = ModelParts(parts=parts)
    if parallel_dims.pp_enabled:
        from titan_plugins.distributed import pipeline

        num_stages = pipeline.num_virtual_stages(job.parallelism)
        split_ids = [stage for stage, _ in split]
        out.stages = pipeline.build_stages(
            list(zip(split_ids, parts)), num_stages, device, parallel_dims.mesh("pp").get_group()
        )
        out.has_first = any(s.is_first for s in out.stages)
        out.has_last = any(s.is_last for s in out.stages)
        out.schedule = pipeline.build_schedule(out.stages, job.parallelism, loss_fn)
    return out
