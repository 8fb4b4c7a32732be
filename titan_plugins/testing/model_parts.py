"""Small pieces a model plugin's own tests share: building a model the way the trainer
does (meta build -> optional pipeline-stage cut -> parallelize -> ``to_empty`` ->
``init_weights``), the job and meshes of a layout, loading full weights into shards,
the loss-parallel-aware loss, one step on a rank's sequence shard against the whole
rows, and a skip when TorchTitan (the numerics reference) is missing. The first-party
plugins' tests use them; a third-party plugin's may too.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

__all__ = [
    "assert_imports_without_torch",
    "assert_loss_parity",
    "assert_same_tensors",
    "build_part",
    "cp_step_against_whole_rows",
    "cpu_histc",
    "cut_stage",
    "full",
    "hf_model",
    "layout",
    "load_full_state_dict",
    "loss_and_grads",
    "require_torchtitan",
    "run_stages",
    "seeded_build",
    "sum_loss",
    "torchtitan_on_cpu",
    "torchtitan_reference",
]


def require_torchtitan(module: str) -> Any:
    """Import ``module`` of TorchTitan 0.2.2 or skip the calling test module (TorchTitan
    is a test-only dependency, installed with ``pip install --no-deps``)."""
    import pytest

    from titan_plugins.testing.torchtitan_ref import import_torchtitan

    try:
        return import_torchtitan(module)
    except ImportError as exc:
        pytest.skip(f"torchtitan 0.2.2 not importable: {exc}", allow_module_level=True)


def seeded_build(build: Callable[[Any], nn.Module], config: Any, seed: int) -> nn.Module:
    """``build(config)`` on meta, materialised on CPU, ``init_weights`` after ``manual_seed(seed)``."""
    with torch.device("meta"):
        model = build(config)
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device("cpu"))
    return model


def layout(par: Mapping[str, Any], training: Mapping[str, Any] | None = None):
    """``(ParallelDims, job)`` for ``parallelism`` values ``par`` on this process group's
    ranks (CPU meshes built); ``training`` values go into ``job.training``."""
    import torch.distributed as dist
    from omegaconf import OmegaConf

    from titan_plugins.config.schema import JobConfig, ParallelismConfig
    from titan_plugins.distributed.parallel_dims import ParallelDims

    dims = ParallelDims.from_config(ParallelismConfig(**par), dist.get_world_size())
    dims.build_meshes("cpu")
    job = OmegaConf.structured(JobConfig(model={}))
    for key, value in par.items():
        job.parallelism[key] = value
    for key, value in (training or {}).items():
        job.training[key] = value
    return dims, job


def cut_stage(model: nn.Module, keep: list[str], first: bool, last: bool, output: str = "output") -> None:
    """What the runtime's pipeline split leaves on one stage: the blocks ``keep``, the
    embedding on the first stage, the final norm and ``output`` on the last."""
    for key in list(model.layers.keys()):
        if key not in keep:
            del model.layers[key]
    if not first:
        model.tok_embeddings = None
    if not last:
        model.norm = None
        setattr(model, output, None)


def build_part(
    build: Callable[[Any], nn.Module], config: Any, parallelize: Callable[..., nn.Module], dims, job,
    stage: Mapping[str, Any] | None = None, *, compute_dtype: torch.dtype | None = None,
) -> nn.Module:
    """The model (or the pipeline ``stage``, ``cut_stage`` arguments) as the trainer builds
    it: meta build, cut, ``parallelize(model, dims, job)``, ``to_empty``, ``init_weights``."""
    with torch.device("meta"):
        part = build(config)
    if compute_dtype is not None:
        part.set_compute_dtype(compute_dtype)
    if stage is not None:
        cut_stage(part, **stage)
    part = parallelize(part, dims, job)
    part.to_empty(device="cpu")
    with torch.no_grad():
        part.init_weights(torch.device("cpu"))
    return part


def load_full_state_dict(model: nn.Module, full_sd: Mapping[str, torch.Tensor]) -> None:
    """Copy a single-process state dict into ``model``'s (possibly DTensor) entries."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    with torch.no_grad():
        for name, t in model.state_dict().items():
            if isinstance(t, DTensor):
                t.to_local().copy_(distribute_tensor(full_sd[name], t.device_mesh, t.placements).to_local())
            else:
                t.copy_(full_sd[name])


def parallel_copy(spec: Any, job: Any, world: int, pm: Any, ref: nn.Module) -> tuple[nn.Module, Any]:
    """This rank's part of ``job``'s layout as the trainer builds it (``build_model_parts``:
    the plugin's plan, adapters placed like their base), holding ``ref``'s weights: for
    comparing one layout against one process. Returns the part and the ``ParallelDims``."""
    from titan_plugins.distributed.parallel_dims import ParallelDims
    from titan_plugins.model.lifecycle import build_model_parts
    from titan_plugins.peft.lora import set_full

    dims = ParallelDims.from_config(job.parallelism, world)
    dims.build_meshes("cpu")
    model = build_model_parts(spec, job, dims, torch.device("cpu"), pm, fused_loss=False).parts[0]
    full_sd = ref.state_dict()
    for name, value in model.state_dict().items():  # the reference's weights, sharded
        set_full(value, full_sd[name])
    return model, dims


def full(x: torch.Tensor) -> torch.Tensor:
    """A DTensor's full tensor, a plain tensor as it is."""
    from torch.distributed.tensor import DTensor

    return x.full_tensor() if isinstance(x, DTensor) else x


def sum_loss(logits: torch.Tensor, labels: torch.Tensor, count: int, *, backward: bool = True) -> torch.Tensor:
    """Summed cross entropy over ``count`` tokens (backward run unless told not to); vocab-sharded
    DTensor logits (loss parallel) are handled inside ``loss_parallel()``. Returns a plain loss."""
    import torch.nn.functional as F
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import loss_parallel

    def run() -> torch.Tensor:
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum") / count
        if backward:
            loss.backward()
        return loss

    if isinstance(logits, DTensor):
        with loss_parallel():
            return full(run())
    return run()


def hf_model(name: str, folder: str, *overrides: str):
    """``(job, config, model, counts)``: model ``name`` from the Hugging Face ``folder`` as
    ``titan-run model=NAME model.hf=FOLDER OVERRIDES...`` composes it, built on CPU,
    initialised, its weights loaded (``counts``: ``load_hf_weights``'), in eval mode."""
    from titan_plugins.config.hydra_glue import model_config
    from titan_plugins.hf.load import load_hf_weights
    from titan_plugins.plugins import get_plugin_manager
    from titan_plugins.train.api import prepare_job

    spec, job, _ = prepare_job([f"model={name}", f"model.hf={folder}", *overrides], get_plugin_manager())
    config = model_config(job.model, spec)
    model = spec.load("build")(config)
    with torch.no_grad():
        model.init_weights()
    counts = load_hf_weights([model], spec, config, folder, partial=bool(job.model.get("hf_partial")))
    return job, config, model.eval(), counts


def one_process_model(spec: Any, job: Any, hf_dir: str | None = None, *, seed: int = 0) -> nn.Module:
    """The model of a composed job as a one-rank run builds it (``lifecycle.materialize``):
    on meta, the PEFT transform (``peft=``), ``to_empty`` on CPU, the seeded
    ``init_weights``, the adapters' init, the cast to ``precision.weight_dtype``, then the
    weights of ``hf_dir``. ``peft=qlora``: with ``hf_dir`` the base is quantized tensor by
    tensor as it is read (never whole at full precision), without it from the random init."""
    from titan_plugins.config.hydra_glue import model_config
    from titan_plugins.hf.load import load_hf_weights
    from titan_plugins.model.lifecycle import apply_peft, build_meta_model, materialize

    model = build_meta_model(spec, job)
    apply_peft(model, spec, job)
    materialize(model, job, torch.device("cpu"), seed=seed, base_later=hf_dir is not None)
    if hf_dir is not None:
        load_hf_weights([model], spec, model_config(job.model, spec), hf_dir, verbose=False,
                        partial=bool(job.model.get("hf_partial")))
    return model


def adapter_grads(model: nn.Module) -> dict[str, torch.Tensor | None]:
    """Every LoRA adapter's gradients after a backward, as ``{"<module>.A": ..., "<module>.B": ...}``."""
    from titan_plugins.peft.lora import adapter_modules

    grads: dict[str, torch.Tensor | None] = {}
    for name, module in adapter_modules(model):
        grads[f"{name}.A"], grads[f"{name}.B"] = module.lora_A.weight.grad, module.lora_B.weight.grad
    return grads


def run_stages(parts: list[nn.Module], x: torch.Tensor) -> torch.Tensor:
    """Pipeline stages one after another on these ranks; what crosses a stage boundary
    must be a plain tensor (as ``torch.distributed.pipelining`` sends it)."""
    for part in parts:
        x = part(x)
        if getattr(part, "output", None) is None:
            assert type(x) is torch.Tensor, "a stage must hand on a plain tensor"
    return x


def loss_and_grads(
    model: nn.Module, tokens: torch.Tensor, labels: torch.Tensor,
    forward: Callable[[nn.Module, torch.Tensor], torch.Tensor] | None = None, *, every_param: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """``(logits, loss, grads)`` of one mean cross-entropy step under the math SDPA kernel
    (``forward(model, tokens)``, default ``model(tokens)``); ``every_param``: a parameter
    without a gradient is an error instead of being left out."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    model.zero_grad(set_to_none=True)
    with sdpa_kernel(SDPBackend.MATH):
        logits = model(tokens) if forward is None else forward(model, tokens)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
        loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if every_param or p.grad is not None}
    return logits.detach(), loss.detach(), grads


def cp_step_against_whole_rows(model: nn.Module, tokens: torch.Tensor, labels: torch.Tensor, rank: int,
                               world: int) -> dict[str, Any]:
    """One summed cross-entropy step of ``model`` on the whole rows ``tokens -> labels`` in this
    process, then on this rank's chunks of them under ``sharded_sequence`` (the WORLD group
    as the cp group), the loss and every gradient summed over the ranks as FSDP over dp x cp
    sums them. Returns ``ref_loss`` (the whole rows'), ``loss`` (the absolute difference),
    ``same_params`` (the same parameters got gradients), ``grad`` and ``worst``: the
    largest gradient difference, relative to that gradient's own size (at least 1e-3 of
    the largest), and its parameter's name."""
    import torch.distributed as dist

    from titan_plugins.components.cp_attention import (
        SequenceShard,
        shard_sequence,
        sharded_sequence,
    )

    count = labels.numel()  # the whole rows' tokens: each rank's sum is its part of the one-process sum

    def step(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        loss = sum_loss(model(x).float(), y, count)
        return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}

    ref_loss, ref = step(tokens, labels)
    with sharded_sequence(SequenceShard(dist.group.WORLD, rank, world, tokens.shape[1])):
        loss, grads = step(shard_sequence(tokens, 1, world, rank), shard_sequence(labels, 1, world, rank))
    dist.all_reduce(loss)
    for g in grads.values():
        dist.all_reduce(g)
    scale = max(g.abs().max().item() for g in ref.values())

    def rel(name: str) -> float:
        return ((grads[name] - ref[name]).abs().max() / max(ref[name].abs().max().item(), 1e-3 * scale)).item()

    worst = max(grads, key=rel)
    return {"ref_loss": ref_loss.item(), "loss": abs(loss.item() - ref_loss.item()),
            "same_params": set(grads) == set(ref), "grad": rel(worst), "worst": worst}


def assert_loss_parity(label: str, base: list[float], losses: list[float], parity: Any) -> None:
    """``losses`` of a parallel run against the single-process ``base``, step by step,
    within ``parity.allows(a, b)``; the run must have trained (the loss moved)."""
    assert len(losses) == len(base)
    diffs = [abs(a - b) for a, b in zip(base, losses)]
    print(f"{label}: max |loss diff| over {len(base)} steps {max(diffs):.2e}")
    for step, (a, b) in enumerate(zip(base, losses), start=1):
        assert parity.allows(a, b), f"{label} step {step}: {b!r} vs single {a!r}"
    assert base[0] != base[-1]  # it trained: equality is not vacuous


def assert_imports_without_torch(*modules: str) -> None:
    """Import ``modules`` in a fresh interpreter and fail if that imported torch (a plugin
    module and its config must stay light: ``titan-plugins list`` imports them)."""
    import subprocess
    import sys

    code = f"import sys, {', '.join(modules)}; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def assert_same_tensors(got: Mapping[str, torch.Tensor], want: Mapping[str, torch.Tensor]) -> None:
    """The same names, and every tensor bitwise equal (e.g. state dicts after the same seeded init)."""
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        assert torch.equal(got[name], value), name


_histc = torch.histc


def cpu_histc(input, bins=100, min=0, max=0, *, out=None):  # noqa: A002 - torch's signature
    """``torch.histc`` for int64 on CPU (TorchTitan's router counts tokens per expert with it,
    and CPU has no int64 kernel): counted in float32, handed back in the input's dtype
    (exact for counts < 2**24)."""
    if input.dtype.is_floating_point:
        return _histc(input, bins=bins, min=min, max=max)
    return _histc(input.float(), bins=bins, min=min, max=max).to(input.dtype)


def torchtitan_on_cpu(monkeypatch: Any) -> None:
    """What a TorchTitan MoE reference needs on CPU: ``cpu_histc`` for ``torch.histc``, and one
    thread (the comparison is bitwise; torch restores nothing else)."""
    monkeypatch.setattr(torch, "histc", cpu_histc)
    torch.set_num_threads(1)


def torchtitan_reference(model_cls: Callable[[Any], nn.Module], args: Any, seq_len: int, seed: int) -> nn.Module:
    """A TorchTitan 0.2.2 model as its trainer builds it: ``update_from_config`` with the
    training ``seq_len`` (no context parallelism, no forced load balance), its SDPA wrapper on
    the math kernel (ours runs under ``sdpa_kernel(MATH)`` too), then ``seeded_build``."""
    from types import SimpleNamespace

    from torch.nn.attention import SDPBackend

    from titan_plugins.testing.torchtitan_ref import import_torchtitan

    attention = import_torchtitan("torchtitan.models.attention")
    attention.ScaledDotProductAttentionWrapper.sdpa_backends = [SDPBackend.MATH]
    args.update_from_config(SimpleNamespace(
        training=SimpleNamespace(seq_len=seq_len),
        parallelism=SimpleNamespace(context_parallel_degree=1),
        debug=SimpleNamespace(moe_force_load_balance=False),
    ))
    return seeded_build(model_cls, args, seed)
