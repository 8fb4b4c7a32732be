"""Cross-entropy fused with the output projection: the full logits are never held.

``defer_head(part, name, ...)`` makes the model part's output head (the last of the
spec's ``PipelineInfo.last_stage_modules``, an ``nn.Linear``) return its *input*, the
final hidden states, tagged with a :class:`HeadRef` (the weight the forward saw, the
chunk size, whether the vocabulary is TP-sharded). :func:`chunked_ce` then computes
the logits ``chunk_size`` positions at a time, so neither the ``[positions, vocab]``
logits nor their gradient exist whole. Two ways, by what the gradient needs:

- gradients in the forward (:class:`_ForwardGradCE`, the default where the head is a
  plain tensor): each chunk's logits give the loss *and* ``softmax - one-hot`` at once,
  projected back through the head right away (the hidden states' gradient, and the
  head's own when it trains); the backward only scales what was kept by the incoming
  gradient. As many head matmuls as the whole-logits path, no recompute (the technique
  of Liger-Kernel's fused linear cross-entropy). For the summed loss always; for the
  per-position loss (``token_nll``, preference objectives) when the head is frozen
  (LoRA), since a per-row weight for the head's own gradient is only known in the
  backward;
- checkpointed chunks otherwise (a TP-sharded head, loss parallel, a trainable head
  under ``token_nll``): the forward keeps only the hidden states, the backward
  recomputes one chunk's logits at a time: one more head matmul per step.

The losses (``loss/token_loss.py``) see the tag and take this path; anything else takes the
old one. The head is called without its module hooks (a TP plan's output hook would
reshard hidden states as if they were logits); what the hooks did is done here: the
hidden states are made a ``Replicate`` DTensor on the head's mesh when its weight is a
TP shard (the all-gather a sequence-parallel plan's input hook does). FSDP finishes
the skipped module's forward from the root (``_force_complete_incomplete_states``);
the head's weight stays unsharded until its unit's backward, which comes after the
loss's.

A model whose forward does work after the head (logit soft-capping, scaling) cannot
take this path: it declares ``titan_fused_loss = False`` (then the head is not
deferred), or the first forward raises one line naming the switch.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from titan_plugins.errors import ConfigError

__all__ = ["HeadRef", "chunked_ce", "defer_head", "defer_heads", "head_ref", "restore_head"]

_TAG = "_titan_head_ref"


@dataclass(frozen=True)
class HeadRef:
    """What the loss needs of the head: its parameters as the forward saw them."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    chunk_size: int
    vocab_parallel: bool  # TP-sharded vocabulary kept sharded (loss_parallel): Shard(-1) logits


def head_ref(output: Any) -> HeadRef | None:
    """The :class:`HeadRef` of a deferred head's output, else ``None`` (logits)."""
    return getattr(output, _TAG, None)


def _replicated_on(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Hidden states as a ``Replicate`` DTensor on a TP-sharded head's mesh (what
    ColwiseParallel's input hook makes of them); unchanged for a plain weight."""
    from torch.distributed.tensor import DTensor, Replicate

    if not isinstance(weight, DTensor):
        return x
    mesh = weight.device_mesh
    if not isinstance(x, DTensor):
        x = DTensor.from_local(x, mesh, [Replicate()] * mesh.ndim, run_check=False)
    if any(not p.is_replicate() for p in x.placements):
        x = x.redistribute(mesh, [Replicate()] * mesh.ndim)
    return x


class _DeferredCall:
    """Mixed into the head's class: ``head(x)`` returns ``x`` tagged, no logits."""

    computes_in_input_dtype = True  # compute_dtype.linear calls the module with x in the run's dtype

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        cfg = self._titan_defer
        weight = self.weight
        h = _replicated_on(x, weight)  # the final norm's output: only the head reads it
        setattr(h, _TAG, HeadRef(weight, self.bias, cfg["chunk_size"], cfg["vocab_parallel"]))
        self._titan_defer["last"] = weakref.ref(h)
        return h


def _check_untouched(part: nn.Module, head: nn.Module, head_name: str):
    """Forward hook on the part: its output must be what the head returned."""

    def hook(_module: nn.Module, _args: Any, output: Any) -> None:
        last = head._titan_defer.pop("last", None)
        if last is not None and last() is not output:
            raise ConfigError(
                f"training.loss_chunk_size={head._titan_defer['chunk_size']}: model "
                f"{type(part).__name__} does work after its head {head_name!r} (e.g. logit soft-capping), "
                "which the fused loss would skip; set training.loss_chunk_size=0 (or declare "
                "titan_fused_loss = False on the model)"
            )

    return hook


def defer_head(part: nn.Module, head_name: str, *, chunk_size: int, vocab_parallel: bool) -> bool:
    """Defer ``part.<head_name>`` (see the module doc); ``False`` where the part has no
    such ``nn.Linear`` head (an earlier pipeline stage) or the model opts out."""
    head = getattr(part, head_name, None)
    if not isinstance(head, nn.Linear) or getattr(part, "titan_fused_loss", True) is False:
        return False
    if isinstance(head, _DeferredCall):
        return True
    cls = type(head)
    head.__class__ = type(f"Deferred{cls.__name__}", (_DeferredCall, cls), {"_titan_original_class": cls})
    head._titan_defer = {"chunk_size": int(chunk_size), "vocab_parallel": bool(vocab_parallel)}
    head._titan_defer_hook = part.register_forward_hook(_check_untouched(part, head, head_name))
    return True


def restore_head(part: nn.Module, head_name: str) -> None:
    """Undo :func:`defer_head` (the head returns logits again)."""
    head = getattr(part, head_name, None)
    if isinstance(head, _DeferredCall):
        head._titan_defer_hook.remove()
        head.__class__ = head._titan_original_class
        del head._titan_defer, head._titan_defer_hook


def _logits(h: torch.Tensor, ref: HeadRef) -> torch.Tensor:
    """One chunk's fp32 logits: in ``h``'s dtype as the head computes them; a TP shard
    gathered to a plain tensor unless the loss is vocab-parallel (as the TP plan does)."""
    from torch.distributed.tensor import DTensor, Replicate

    w = ref.weight if ref.weight.dtype == h.dtype else ref.weight.to(h.dtype)
    b = None if ref.bias is None else ref.bias.to(h.dtype)
    logits = F.linear(h, w, b)
    if isinstance(logits, DTensor) and not ref.vocab_parallel:
        logits = logits.redistribute(placements=[Replicate()] * logits.device_mesh.ndim).to_local()
    return logits.float()


def _chunk_sum(h: torch.Tensor, labels: torch.Tensor, ref: HeadRef, ignore_index: int) -> torch.Tensor:
    return F.cross_entropy(_logits(h, ref), labels, reduction="sum", ignore_index=ignore_index)


def _chunk_nll(h: torch.Tensor, labels: torch.Tensor, ref: HeadRef, ignore_index: int) -> torch.Tensor:
    return F.cross_entropy(_logits(h, ref), labels, reduction="none", ignore_index=ignore_index)


class _ForwardGradCE(torch.autograd.Function):
    """Cross-entropy of ``h W^T + b`` against ``y`` chunk by chunk, each chunk's gradient
    computed in the forward (see the module doc). ``reduction="sum"``: a scalar, any of
    ``h``, ``W``, ``b`` may train; ``"none"``: per position, only ``h`` may train.

    The loss values are the very ops of ``F.cross_entropy`` (log-softmax, then NLL) on
    the same chunk logits; the gradient is ``exp(log-softmax) - one-hot`` (0 on ignored
    rows) in the logits' dtype, as autograd hands it to the head's matmul. The head's
    and bias's gradients accumulate over chunks in fp32. Backward once only."""

    @staticmethod
    def forward(ctx, h, weight, bias, y, chunk, ignore_index, reduction):  # noqa: PLR0913
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        w = weight if weight.dtype == h.dtype else weight.to(h.dtype)
        b = None if bias is None else bias.to(h.dtype)
        grad_h = torch.empty_like(h) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        grad_b = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if need_b else None
        losses = []
        for start in range(0, h.shape[0], chunk):
            hc, yc = h[start:start + chunk], y[start:start + chunk]
            lsm = F.linear(hc, w, b).float().log_softmax(-1)
            losses.append(F.nll_loss(lsm, yc, reduction=reduction, ignore_index=ignore_index))
            g = lsm.exp_()  # softmax, in place of the log-softmax (no longer needed)
            counted = yc != ignore_index
            rows = counted.nonzero().squeeze(1)
            g[rows, yc[rows]] -= 1.0
            g[~counted] = 0.0
            g = g.to(h.dtype)
            if need_h:
                torch.mm(g, w, out=grad_h[start:start + chunk])
            if need_w:
                grad_w += (g.t() @ hc).float()
            if need_b:
                grad_b += g.sum(0).float()
            del lsm, g
        ctx.reduction, ctx.dtypes = reduction, (weight.dtype, None if bias is None else bias.dtype)
        ctx.save_for_backward(grad_h, grad_w, grad_b)
        if reduction == "sum":
            total = losses[0]
            for part in losses[1:]:
                total = total + part
            return total
        return torch.cat(losses)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        grad_h, grad_w, grad_b = ctx.saved_tensors
        if ctx.reduction == "sum":
            grad_h = None if grad_h is None else grad_h * grad_out.to(grad_h.dtype)
            grad_w = None if grad_w is None else (grad_w * grad_out).to(ctx.dtypes[0])
            grad_b = None if grad_b is None else (grad_b * grad_out).to(ctx.dtypes[1])
        else:  # per position: each row of the hidden states' gradient by its own weight
            grad_h = None if grad_h is None else grad_h * grad_out.unsqueeze(1).to(grad_h.dtype)
        return grad_h, grad_w, grad_b, None, None, None, None


def _forward_grad_applies(h: torch.Tensor, ref: HeadRef, reduction: str) -> bool:
    from torch.distributed.tensor import DTensor

    if not torch.is_grad_enabled() or isinstance(h, DTensor) or isinstance(ref.weight, DTensor):
        return False
    trains_head = ref.weight.requires_grad or (ref.bias is not None and ref.bias.requires_grad)
    return reduction == "sum" or not trains_head


def chunked_ce(hidden: torch.Tensor, labels: torch.Tensor, ref: HeadRef, *, ignore_index: int,
               reduction: str) -> torch.Tensor:
    """``reduction="sum"``: the summed token cross-entropy; ``"none"``: per position
    ``labels.shape``. ``hidden`` is ``[batch, seq, dim]``, ``labels`` ``[batch, seq]``."""
    h = hidden.flatten(0, 1)
    y = labels.flatten(0, 1)
    fn = _chunk_sum if reduction == "sum" else _chunk_nll
    step = ref.chunk_size if ref.chunk_size > 0 else h.shape[0]
    if step >= h.shape[0]:
        out = fn(h, y, ref, ignore_index)  # one chunk: the very ops of the whole-logits path
        return out if reduction == "sum" else out.view(labels.shape)
    if _forward_grad_applies(h, ref, reduction):
        out = _ForwardGradCE.apply(h, ref.weight, ref.bias, y, step, ignore_index, reduction)
        return out if reduction == "sum" else out.view(labels.shape)
    parts = []
    for start in range(0, h.shape[0], step):
        args = (h[start:start + step], y[start:start + step], ref, ignore_index)
        # Checkpointed: only the chunk's hidden states are saved, its logits recomputed
        # in the backward (one chunk alive at a time), never under no_grad.
        parts.append(checkpoint(fn, *args, use_reentrant=False) if torch.is_grad_enabled() else fn(*args))
    if reduction == "sum":
        total = parts[0]
        for p in parts[1:]:
            total = total + p
        return total
    return torch.cat(parts).view(labels.shape)


def defer_heads(parts: list[nn.Module], spec: Any, job: Any, parallel_dims: Any) -> int:
    """The lifecycle's hook: defer the head of every part that holds it (the last
    pipeline stage), unless ``training.loss_chunk_size=0``; returns how many.

    The head is the last of ``spec.pipeline.last_stage_modules`` (``output`` without
    pipeline information), never found by model name. Under
    ``parallelism.fsdp_reshard_after_forward=always`` FSDP frees the head's gathered
    weight when the forward ends, before the loss could use it: the plain path then."""
    chunk = int(job.training.get("loss_chunk_size", 0))
    if chunk == 0:
        return 0
    policy = str(getattr(job.parallelism.get("fsdp_reshard_after_forward"), "value",
                         job.parallelism.get("fsdp_reshard_after_forward")))
    if policy == "always":
        return 0
    info = spec.pipeline
    name = info.last_stage_modules[-1] if info is not None and info.last_stage_modules else "output"
    vocab_parallel = bool(parallel_dims.tp_enabled and job.parallelism.get("loss_parallel", False))
    return sum(defer_head(part, name, chunk_size=chunk, vocab_parallel=vocab_parallel) for part in parts)
