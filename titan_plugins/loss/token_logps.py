"""Per-token log-probabilities and entropies of a policy's output, as online RL reads
them: the logits divided by a sampling ``temperature`` first (TRL's GRPOTrainer scores
every log-prob and entropy at the temperature it samples with).

``output`` is what the model's last part returned: whole logits, or a deferred head's
hidden states (``loss/fused.py``), whose logits are computed here a chunk of positions
at a time, each chunk checkpointed (its logits recomputed in the backward), so the
whole ``[positions, vocab]`` logits never exist at once. ``last_logits`` is the
decoding side: the logits of the last position, for sampling the next token.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from titan_plugins.loss.fused import HeadRef, _logits, head_ref
from titan_plugins.loss.token_loss import IGNORE_INDEX

__all__ = ["last_logits", "token_logps"]


def _plain(x: torch.Tensor) -> torch.Tensor:
    """A vocabulary-sharded DTensor (TP's loss_parallel) as a whole tensor (differentiable)."""
    from torch.distributed.tensor import DTensor

    return x.full_tensor() if isinstance(x, DTensor) else x


def _chunk(logits: torch.Tensor, labels: torch.Tensor, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(log p(label), entropy)`` per row of ``[n, vocab]`` logits at ``temperature``."""
    z = _plain(logits).float() / temperature
    logp = torch.log_softmax(z, dim=-1)
    safe = labels.clamp(min=0)
    picked = logp.gather(-1, safe.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(-1)
    counted = labels != IGNORE_INDEX
    return picked.masked_fill(~counted, 0.0), entropy.masked_fill(~counted, 0.0)


def _head_chunk(h: torch.Tensor, labels: torch.Tensor, ref: HeadRef, temperature: float):
    return _chunk(_logits(h, ref), labels, temperature)


def token_logps(output: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logps, entropy)``, each ``labels.shape`` in fp32, 0 where the label is
    ``IGNORE_INDEX``: the log-probability of each label under ``softmax(logits / T)``
    and that distribution's entropy."""
    ref = head_ref(output)
    if ref is None:
        logps, entropy = _chunk(output.flatten(0, 1), labels.flatten(0, 1), temperature)
        return logps.view(labels.shape), entropy.view(labels.shape)
    h, y = output.flatten(0, 1), labels.flatten(0, 1)
    step = ref.chunk_size if ref.chunk_size > 0 else h.shape[0]
    parts = []
    for start in range(0, h.shape[0], step):
        args = (h[start:start + step], y[start:start + step], ref, temperature)
        parts.append(checkpoint(_head_chunk, *args, use_reentrant=False) if torch.is_grad_enabled()
                     else _head_chunk(*args))
    logps = torch.cat([p[0] for p in parts]).view(labels.shape)
    entropy = torch.cat([p[1] for p in parts]).view(labels.shape)
    return logps, entropy


def last_logits(output: torch.Tensor) -> torch.Tensor:
    """The fp32 logits ``[batch, vocab]`` of the last position of ``output`` (whole
    logits, or a deferred head's hidden states)."""
    ref = head_ref(output)
    if ref is None:
        return _plain(output[:, -1, :]).float()
    return _logits(output[:, -1, :], ref)
