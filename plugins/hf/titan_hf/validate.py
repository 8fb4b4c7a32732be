"""What a folder's structure cannot take, refused in one line before any rank starts."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from titan_hf.config import HFModelConfig, hf_dict
from titan_hf.context_parallel import check_cp
from titan_plugins.errors import ConfigError

if TYPE_CHECKING:
    from titan_plugins.distributed.parallel_dims import ParallelDims

__all__ = ["expert_plan", "layer_plan", "validate"]

#: transformers' TP style names this plugin maps onto torch's styles (titan_hf.parallelize)
TP_STYLES = frozenset({"colwise", "rowwise", "colwise_gather_output", "rowwise_split_input",
                       "replicated_with_grad_allreduce", "embedding_rowwise"})


#: transformers' EP style names this plugin applies (transformers' own expert_parallel styles)
EP_STYLES = frozenset({"grouped_gemm", "ep_dispatch_experts"})


def _per_layer(plan: dict[str, str] | None) -> dict[str, str]:
    return {k[len("layers.*."):]: v for k, v in (plan or {}).items() if k.startswith("layers.*.")}


def layer_plan(hf: Any) -> dict[str, str]:
    """The decoder-layer part of the model's ``base_model_tp_plan``, keyed by the module
    path inside one layer (``self_attn.q_proj``); where it reaches no layer module,
    ``titan_hf.tp_plan`` derives one."""
    return _per_layer(getattr(hf, "base_model_tp_plan", None))


def expert_plan(hf: Any) -> dict[str, str]:
    """The decoder-layer part of the model's ``base_model_ep_plan`` (``mlp.experts.down_proj:
    grouped_gemm``, ``mlp.experts: ep_dispatch_experts``)."""
    return _per_layer(getattr(hf, "base_model_ep_plan", None))


def _check_ep(config: HFModelConfig, hf: Any, values: dict[str, Any], dims: ParallelDims) -> None:
    arch, ep = config.architecture, dims.ep
    experts = values.get("num_local_experts") or values.get("num_experts")
    if not experts:
        raise ConfigError(f"parallelism.ep={ep}: {arch} has no experts")
    plan = expert_plan(hf)
    if "ep_dispatch_experts" not in plan.values():
        raise ConfigError(f"parallelism.ep={ep}: {arch} declares no expert-parallel plan for its decoder layers "
                          "(transformers' base_model_ep_plan); shard its experts with dp_shard")
    odd = sorted({s for s in plan.values() if s not in EP_STYLES})
    if odd:
        raise ConfigError(f"parallelism.ep={ep}: {arch}'s base_model_ep_plan uses style {odd[0]!r}, which "
                          f"model=hf does not apply (it applies {', '.join(sorted(EP_STYLES))})")
    if experts % ep:
        raise ConfigError(f"parallelism.ep={ep}: {arch} has {experts} experts, not divisible by it")
    try:  # transformers' EP code (token dispatch included) arrived within 5.x
        import transformers.distributed.expert_parallel  # noqa: F401
    except ImportError:
        import transformers

        raise ConfigError(f"parallelism.ep={ep}: transformers {transformers.__version__} has no "
                          "transformers.distributed.expert_parallel; model=hf's EP is tested with 5.25") from None
    if dims.etp > 1:  # transformers' plan places whole experts; it has no expert tensor parallelism
        raise ConfigError(f"parallelism.etp={dims.etp}: model=hf shards whole experts over parallelism.ep "
                          "(transformers' base_model_ep_plan); set parallelism.etp=1")


def _check_tp(config: HFModelConfig, hf: Any, tp: int, *, sequence_parallel: bool) -> None:
    """Head and width counts, then the layers' plan (declared, else derived; read from
    the model built on meta, so a refusal comes before launch, not from every rank): its
    styles, the sizes it splits, and sequence parallelism beside it."""
    import torch

    from titan_hf.model import build
    from titan_hf.parallelize import check_sequence_parallel
    from titan_hf.tp_plan import check_divisible, check_left_out, tp_plans

    arch = config.architecture
    for key, n in (("n_heads", config.n_heads), ("n_kv_heads", config.n_kv_heads)):
        if n % tp:
            raise ConfigError(f"parallelism.tp={tp}: model.{key}={n} is not divisible by it")
    for key, n in (("intermediate_size", getattr(hf, "intermediate_size", None)), ("vocab_size", config.vocab_size)):
        if n and n % tp:
            raise ConfigError(f"parallelism.tp={tp}: {key}={n} is not divisible by it")
    with torch.device("meta"):
        model = build(config)
    try:
        plans = tp_plans(model)
    except ConfigError as exc:
        raise ConfigError(f"parallelism.tp={tp}: {exc}") from None
    odd = sorted({s for plan in plans.plans.values() for s in plan.values() if s not in TP_STYLES})
    if odd:
        raise ConfigError(f"parallelism.tp={tp}: {arch}'s base_model_tp_plan uses style {odd[0]!r}, which "
                          f"model=hf does not map (it maps {', '.join(sorted(TP_STYLES))})")
    check_divisible(model, plans, tp)
    check_left_out(model, plans, tp)
    if sequence_parallel:
        check_sequence_parallel(model)


def validate(config: HFModelConfig, parallel_dims: ParallelDims) -> None:
    """Raise ``ConfigError`` (one line) for a layout or field this model cannot take."""
    values = hf_dict(config)  # "model.hf is not set" when neither a folder nor a flavor gave the model
    from titan_hf.model import hf_config_object, layer_kinds

    hf = hf_config_object(config)
    for i, kind in enumerate(layer_kinds(hf)):
        if kind not in ("full_attention", "sliding_attention"):
            raise ConfigError(f"config.json: layer_types[{i}]={kind!r}: model=hf runs full and sliding attention only")
    n_layers = config.n_layers
    if str(getattr(config.attn_mask, "value", config.attn_mask)) == "block_causal":
        if parallel_dims.pp > 1:
            raise ConfigError(f"model.attn_mask=block_causal with parallelism.pp={parallel_dims.pp}: model=hf finds "
                              "documents from the token ids, which later pipeline stages do not see")
        if not isinstance(hf.eos_token_id, int) and not (isinstance(hf.eos_token_id, list) and hf.eos_token_id):
            raise ConfigError("model.attn_mask=block_causal: config.json has no eos_token_id to end documents at")
    if getattr(parallel_dims, "cp", 1) > 1:
        check_cp(hf, parallel_dims.cp)
    if parallel_dims.ep > 1:
        _check_ep(config, hf, values, parallel_dims)
    if parallel_dims.tp > 1:
        _check_tp(config, hf, parallel_dims.tp, sequence_parallel=getattr(parallel_dims, "sequence_parallel", True))
    if parallel_dims.pp > 1 and config.enable_weight_tying:
        raise ConfigError(f"model.enable_weight_tying=true cannot run with parallelism.pp={parallel_dims.pp}: "
                          "the embedding lives on the first stage and the tied head on the last")
    if parallel_dims.pp > 1 and n_layers < parallel_dims.pp:
        raise ConfigError(f"parallelism.pp={parallel_dims.pp}: model.n_layers={n_layers} gives a stage no layer")


def check_decoding(config: HFModelConfig) -> None:
    """Before launch, where the run samples with the KV cache (``ModelSpec.check_decoding``):
    the refusals ``HFCausalLM._check_decoding`` would otherwise raise at the first cached
    forward, inside the ranks (``titan_hf.model.decoding_refusal``)."""
    from titan_hf.layer_call import cache_keyword
    from titan_hf.model import decoding_refusal, hf_config_object
    from titan_hf.state_dict_adapter import meta_shell
    from titan_hf.structure import find_structure

    shell = meta_shell(config)
    base = shell.get_submodule(find_structure(shell).base)
    why = decoding_refusal(config.architecture, cache_keyword(base), hf_config_object(config))
    if why is not None:
        raise ConfigError(f"{why} (objective rollouts decode with it: use rollout=file, or another model)")
