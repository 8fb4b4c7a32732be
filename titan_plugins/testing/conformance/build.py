"""Module contracts on one process: build on meta, init_weights, forward and backward."""

from __future__ import annotations

from typing import Any

from titan_plugins.testing.conformance.contract import CheckResult, ContractError, one_line, where
from titan_plugins.testing.conformance.session import Initialised, Session, open_session
from titan_plugins.testing.conformance.target import Target

__all__ = ["check_forward_backward", "check_init_weights", "check_meta_build", "initialise"]


def check_meta_build(target: Target | Session) -> CheckResult:
    """``build(config)`` works under ``torch.device("meta")``: every parameter and
    buffer is on meta, and the model has ``init_weights(buffer_device=None)``."""
    import inspect

    import torch
    from torch import nn

    fix_meta = ("the core builds on meta and materializes with to_empty: create tensors without an "
                "explicit device (nn.Parameter(torch.empty(...)), register_buffer) and never call "
                ".to(device), numpy or data-dependent code in __init__")
    session = open_session(target)
    try:
        model = session.build_meta()
    except ContractError:
        raise
    except Exception as exc:
        raise ContractError("meta-build", f"build(config) under torch.device('meta') raised "
                            f"{one_line(exc)}{where(exc)}", fix_meta) from None
    if not isinstance(model, nn.Module):
        raise ContractError("meta-build", f"build(config) returned {type(model).__name__}, not an nn.Module",
                            "return the model instance from build")
    for kind, named in (("parameter", model.named_parameters()), ("buffer", model.named_buffers())):
        for name, tensor in named:
            if tensor.device != torch.device("meta"):
                raise ContractError("meta-build", f"{kind} {name!r} was created on {tensor.device} "
                                    "under torch.device('meta')", fix_meta)
    init = getattr(model, "init_weights", None)
    if not callable(init):
        raise ContractError("meta-build", f"{type(model).__name__} has no init_weights method",
                            "define init_weights(self, buffer_device=None) that initialises every "
                            "parameter and rebuilds non-persistent buffers on buffer_device")
    try:
        inspect.signature(init).bind(buffer_device=None)
    except TypeError:
        raise ContractError("meta-build", "init_weights does not accept buffer_device=",
                            "define init_weights(self, buffer_device=None)") from None
    return None


def _all_tensors(model) -> dict[str, Any]:
    out = dict(model.named_parameters())
    out.update(dict(model.named_buffers()))
    return out


def check_init_weights(target: Target | Session) -> CheckResult:
    """``init_weights`` sets every parameter and floating buffer (nothing is left as
    ``to_empty`` left it), gives bitwise equal weights for one seed, and uses the
    seed (another seed gives other weights)."""
    initialise(open_session(target))
    return None


def initialise(session: Session) -> Initialised:
    """The models of seeds 0 and 1 once the init-weights contract holds (computed once
    per session; what the state-dict and Hugging Face checks inspect)."""
    import torch

    if session.initialised is not None:
        return session.initialised
    check_meta_build(session)
    step = "init_weights(buffer_device) after to_empty"
    try:
        first = session.materialize(0, poison=True)
    except Exception as exc:
        raise ContractError("init-weights", f"{step} raised {one_line(exc)}{where(exc)}",
                            "make init_weights work on a materialized (to_empty) model") from None
    params = dict(first.named_parameters())
    for name, tensor in _all_tensors(first).items():
        if (tensor.is_floating_point() or tensor.is_complex()) and torch.isnan(tensor).any():
            if name in params:
                raise ContractError(
                    "init-weights", f"parameter {name!r} is not initialised by init_weights (it keeps what "
                    "to_empty left)", "initialise every parameter in init_weights: the model is built on "
                    "meta, so what __init__ did is lost")
            raise ContractError(
                "init-weights", f"buffer {name!r} is not set by init_weights (it keeps what to_empty left)",
                "rebuild buffers in init_weights(buffer_device), e.g. self.freqs_cis = "
                "precompute(..., device=buffer_device)")
    second = session.materialize(0, poison=True)
    a, b = _all_tensors(first), _all_tensors(second)
    for name, tensor in a.items():
        if not torch.equal(tensor, b[name]):
            raise ContractError(
                "init-weights", f"two initialisations with seed 0 differ in {name!r}",
                "draw all randomness from torch's global generator (the core calls torch.manual_seed "
                "before init_weights); no unseeded torch.Generator, time or os based seeds")
    other_model = session.materialize(1)
    other = _all_tensors(other_model)
    if params and all(torch.equal(a[name], other[name]) for name in params):
        raise ContractError("init-weights", "seeds 0 and 1 give identical parameters",
                            "initialise parameters randomly from torch's global generator (nn.init.*)")
    session.initialised = Initialised(first, other_model)
    return session.initialised


def check_forward_backward(target: Target | Session, *, batch: int = 2) -> CheckResult:
    """On one rank: ``forward(tokens)`` of ``[B, S]`` ids returns plain ``[B, S, V]``
    logits, the cross-entropy loss is finite and ``backward`` gives every parameter a
    finite gradient."""
    import torch
    import torch.nn.functional as F

    session = open_session(target)
    model = session.materialize(0)
    model.train()
    vocab = session.vocab_size(model)
    seq = session.seq_len()
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, (batch, seq + 1), generator=gen)
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    try:
        logits = model(inputs)
    except Exception as exc:
        raise ContractError("forward-backward", f"forward on [{batch}, {seq}] token ids raised "
                            f"{one_line(exc)}{where(exc)}", "forward(tokens) takes int64 ids "
                            "[batch, seq] on the first stage") from None
    if type(logits) is not torch.Tensor:
        raise ContractError("forward-backward", f"forward returned {type(logits).__name__}",
                            "return the logits as a plain tensor")
    if tuple(logits.shape) != (batch, seq, vocab):
        raise ContractError("forward-backward", f"forward returned shape {tuple(logits.shape)}, "
                            f"expected [batch, seq, vocab] = {[batch, seq, vocab]}",
                            "return logits [B, S, V] from the last stage")
    loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
    if not torch.isfinite(loss):
        raise ContractError("forward-backward", f"the loss of a freshly initialised model is {loss.item()}",
                            "check init_weights and the forward for overflow or NaN")
    try:
        loss.backward()
    except Exception as exc:
        raise ContractError("forward-backward", f"backward raised {one_line(exc)}{where(exc)}",
                            "keep the forward differentiable (no in-place ops on leaves, no .data)") from None
    unused = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]
    if unused:
        more = f" (+{len(unused) - 3} more)" if len(unused) > 3 else ""
        raise ContractError("forward-backward", f"parameters get no gradient: {', '.join(unused[:3])}{more}",
                            "every parameter must take part in forward (FSDP and DDP need it); "
                            "hold constants as buffers instead")
    for name, p in model.named_parameters():
        if p.grad is not None and not torch.isfinite(p.grad).all():
            raise ContractError("forward-backward", f"the gradient of {name!r} is not finite",
                                "check the forward for overflow or NaN")
    return None
