"""The pipeline-split contract: the core's split into 2 stages initialises and runs
per stage, and the stages chained give the whole model's logits (one process)."""

from __future__ import annotations

from titan_plugins.testing.conformance.contract import CheckResult, ContractError, one_line, where
from titan_plugins.testing.conformance.session import Session, open_session
from titan_plugins.testing.conformance.target import Target

__all__ = ["check_pipeline_split"]


def check_pipeline_split(target: Target | Session) -> CheckResult:
    """With ``PipelineInfo``: blocks live in an ``nn.ModuleDict`` keyed "0".."n-1";
    split into 2 stages by the core, modules a stage does not own are None, each
    stage initialises and runs (later stages take hidden states), parameter names
    are kept, and the stages chained reproduce the whole model's logits."""
    import types

    import torch
    from torch import nn

    from titan_plugins.distributed.pipeline import split_model, stage_inputs

    session = open_session(target).for_kind("pp")
    target = session.target
    info = session.spec.pipeline
    if info is None:
        return f"model {target.model!r} registers no PipelineInfo (no pipeline parallelism)"
    meta = session.build_meta()
    layers = getattr(meta, info.layers_attr, None)
    if not isinstance(layers, nn.ModuleDict):
        raise ContractError(
            "pipeline-split", f"model.{info.layers_attr} is {type(layers).__name__}, not an nn.ModuleDict",
            f"keep the blocks in self.{info.layers_attr} = nn.ModuleDict({{str(i): Block(...) for i in "
            "range(n_layers)}}) so a stage can delete the ones it does not own (and names stay stable)")
    keys = list(layers.keys())
    if keys != [str(i) for i in range(len(keys))]:
        raise ContractError("pipeline-split", f"model.{info.layers_attr} is keyed {keys[:4]}..., not '0'..'n-1'",
                            "key the blocks by their index as strings")
    for name in (*info.first_stage_modules, *info.last_stage_modules):
        if getattr(meta, name, None) is None:
            raise ContractError("pipeline-split", f"PipelineInfo names {name!r}, which the model does not have",
                                "list in first_stage_modules/last_stage_modules the attribute names of "
                                "the modules only the first/last stage owns")
    if len(keys) < 2:
        return f"model has {len(keys)} layer(s): a pipeline split needs at least 2 (override model.n_layers)"
    full = session.materialize(0)
    full_sd = full.state_dict()
    vocab = session.vocab_size(full)
    seq = session.seq_len()
    tokens = torch.randint(0, vocab, (2, seq), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = full(tokens)
    parallelism = types.SimpleNamespace(pp=2, pp_stages_per_rank=1)
    stages = [part for r in range(2) for _, part in split_model(meta, info, r, parallelism)]
    for index, stage in enumerate(stages):
        absent = info.last_stage_modules if index == 0 else info.first_stage_modules
        for name in absent:
            if getattr(stage, name, "missing") is not None:
                raise ContractError("pipeline-split", f"stage {index} still has {name!r} after the split",
                                    "do not re-create modules outside __init__")
        what = f"stage {index} of 2 (where {', '.join(absent)} {'is' if len(absent) == 1 else 'are'} None)"
        stage.to_empty(device="cpu")
        try:
            with torch.no_grad():
                stage.init_weights(buffer_device=torch.device("cpu"))
        except Exception as exc:
            raise ContractError("pipeline-split", f"init_weights fails on {what}: {one_line(exc)}{where(exc)}",
                                "skip modules that are None in init_weights (`if self.norm is not None:`)") from None
        stage_sd = stage.state_dict()
        foreign = [k for k in stage_sd if k not in full_sd]
        if foreign:
            raise ContractError("pipeline-split", f"{what} has parameters the whole model lacks: {foreign[:3]}",
                                "keep parameter names (FQNs) identical on every stage")
        stage.load_state_dict({k: full_sd[k] for k in stage_sd}, strict=True)
    if info.stage_inputs and not callable(getattr(stages[-1], info.stage_inputs, None)):
        raise ContractError("pipeline-split", f"PipelineInfo.stage_inputs={info.stage_inputs!r} is not a "
                            "method of the model", "define it as (tokens) -> dict[str, Tensor] on the model class")
    extra = stage_inputs(stages[-1], info, tokens)  # what the trainer hands every stage
    h = tokens
    for index, stage in enumerate(stages):
        absent = info.last_stage_modules if index == 0 else info.first_stage_modules
        try:
            with torch.no_grad():
                h = stage(h, **extra)
        except Exception as exc:
            raise ContractError(
                "pipeline-split", f"forward fails on stage {index} of 2 (where {', '.join(absent)} is None; "
                f"input {'token ids' if index == 0 else 'hidden states'}): {one_line(exc)}{where(exc)}",
                "in forward, h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens, "
                "and likewise skip norm/output when they are None") from None
        if type(h) is not torch.Tensor:
            raise ContractError("pipeline-split", f"stage {index} returned {type(h).__name__}",
                                "stages exchange plain tensors")
    if h.shape != expected.shape or not torch.allclose(h, expected, rtol=1e-5, atol=1e-5):
        diff = (h - expected).abs().max().item() if h.shape == expected.shape else "shape " + str(tuple(h.shape))
        raise ContractError("pipeline-split", f"the two stages chained do not give the whole model's logits "
                            f"(max difference {diff})", "a stage's forward must do exactly the whole model's "
                            "computation for the blocks it owns; keep global state (positions, caches) "
                            "independent of which blocks are present")
    return None
