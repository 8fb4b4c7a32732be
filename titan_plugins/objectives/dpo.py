"""``objective=dpo``: the DPO family on preference pairs, as TRL computes it.

A batch is ``[chosen rows; rejected rows]`` (TRL's layout: pair ``i`` is rows ``i`` and
``i + n``), labels ``IGNORE_INDEX`` outside the completion. A sequence's log-prob is the
sum of its completion tokens' log-probs (``-token_nll``); ``*_logratios`` are the
policy's minus the reference's. Per pair, with ``d = chosen_logratios - rejected_logratios``:

- ``sigmoid`` (DPO): ``-logsigmoid(beta d)``
- ``hinge``: ``relu(1 - beta d)``
- ``ipo``: ``(d' - 1/(2 beta))^2`` with each logratio divided by its completion length
- ``robust``: ``(-(1-e) logsigmoid(beta d) + e logsigmoid(-beta d)) / (1 - 2e)``, ``e`` = label_smoothing

and the reference-free ones on *average* completion log-probs ``a`` (TRL's CPO/ORPO trainers):

- ``simpo``: ``-(1-e) logsigmoid(beta (a_c - a_r) - simpo_gamma) - e logsigmoid(-(...))``
- ``orpo``: ``nll(chosen) - beta logsigmoid(log_odds)``, ``log_odds = (a_c - a_r) -
  (log(1 - exp a_c) - log(1 - exp a_r))``; ``nll`` the token-mean cross-entropy of the
  chosen completions (the SFT term).

The loss is the mean over the global batch's pairs (ORPO's SFT term: over its chosen
tokens). Rewards as TRL logs them: ``beta * logratio`` (reference-free: ``beta * a``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from titan_plugins.components.cp_attention import owns_rows, row_sum
from titan_plugins.errors import ConfigError
from titan_plugins.loss.token_loss import IGNORE_INDEX, token_nll
from titan_plugins.objectives.base import Objective

if TYPE_CHECKING:
    from omegaconf import DictConfig

__all__ = ["LOSS_TYPES", "REFERENCE_FREE", "DPOObjective", "SequenceLogps", "pair_losses", "sequence_logps"]

LOSS_TYPES = ("sigmoid", "ipo", "hinge", "robust", "simpo", "orpo")
REFERENCE_FREE = ("simpo", "orpo")
PREFERENCE_DATA = ("preference", "preference_sample")


class SequenceLogps(tuple):
    """``(logps, lengths)``: per row, the completion's summed log-prob and token count."""


def _nll(output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """``token_nll`` as a plain tensor: under TP's loss_parallel it is a DTensor, and the
    pair losses' ops (logsigmoid's backward) have no DTensor rule; ``full_tensor`` is
    differentiable, so the gradient still reaches the sharded logits."""
    from torch.distributed.tensor import DTensor

    nll = token_nll(output, labels)
    return nll.full_tensor() if isinstance(nll, DTensor) else nll


def sequence_logps(output: torch.Tensor, labels: torch.Tensor, nll: torch.Tensor | None = None) -> SequenceLogps:
    """Under context parallelism each rank holds chunks of every row: its sums are
    added over the cp group (``row_sum``), every rank then has the whole rows'."""
    nll = _nll(output, labels) if nll is None else nll
    logps = row_sum(-nll.sum(-1))
    lengths = row_sum((labels != IGNORE_INDEX).sum(-1).to(logps.dtype))
    return SequenceLogps((logps, lengths))


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """``log(1 - exp(x))`` for ``x < 0``, stable on both sides of ``-ln 2``."""
    return torch.where(x < -0.6931471805599453, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def pair_losses(loss_type: str, *, beta: float, label_smoothing: float, simpo_gamma: float,
                chosen: torch.Tensor, rejected: torch.Tensor, chosen_len: torch.Tensor,
                rejected_len: torch.Tensor, ref_chosen: torch.Tensor | None = None,
                ref_rejected: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(per-pair loss, chosen rewards, rejected rewards)`` from summed completion
    log-probs (``chosen``/``rejected``, policy; ``ref_*``, reference) and lengths."""
    if loss_type in REFERENCE_FREE:
        a_c, a_r = chosen / chosen_len.clamp(min=1.0), rejected / rejected_len.clamp(min=1.0)
        if loss_type == "simpo":
            logits = (a_c - a_r) - simpo_gamma / beta
            losses = (-F.logsigmoid(beta * logits) * (1 - label_smoothing)
                      - F.logsigmoid(-beta * logits) * label_smoothing)
        else:  # orpo: the odds-ratio term (the SFT term is added by the objective)
            log_odds = (a_c - a_r) - (_log1mexp(a_c) - _log1mexp(a_r))
            losses = -beta * F.logsigmoid(log_odds)
        return losses, beta * a_c.detach(), beta * a_r.detach()
    assert ref_chosen is not None and ref_rejected is not None
    chosen_lr, rejected_lr = chosen - ref_chosen, rejected - ref_rejected
    delta = chosen_lr - rejected_lr
    if loss_type == "sigmoid":
        losses = -F.logsigmoid(beta * delta)
    elif loss_type == "hinge":
        losses = torch.relu(1 - beta * delta)
    elif loss_type == "ipo":
        ipo_delta = chosen_lr / chosen_len.clamp(min=1.0) - rejected_lr / rejected_len.clamp(min=1.0)
        losses = (ipo_delta - 1 / (2 * beta)) ** 2
    elif loss_type == "robust":
        clean = -(1 - label_smoothing) * F.logsigmoid(beta * delta)
        flipped = -label_smoothing * F.logsigmoid(-beta * delta)
        losses = (clean - flipped) / (1 - 2 * label_smoothing)
    else:
        raise ValueError(f"unknown loss_type {loss_type!r}")
    return losses, beta * chosen_lr.detach(), beta * rejected_lr.detach()


def _halves(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    n = x.shape[0] // 2
    return x[:n], x[n:]


class DPOObjective(Objective):
    """The DPO family (module docstring); knobs from ``objective.*``."""

    def __init__(self, config: Any = None, spec: Any = None) -> None:
        super().__init__(config, spec)
        get = (lambda k, d: getattr(config, k, d)) if config is not None else (lambda k, d: d)
        self.loss_type = str(get("loss_type", "sigmoid"))
        self.beta = float(get("beta", 0.1))
        self.label_smoothing = float(get("label_smoothing", 0.0))
        self.simpo_gamma = float(get("simpo_gamma", 0.5))
        if self.loss_type not in LOSS_TYPES:
            raise ConfigError(f"objective.loss_type={self.loss_type}: expected one of {', '.join(LOSS_TYPES)}")
        if self.beta <= 0:
            raise ConfigError(f"objective.beta={self.beta:g} must be positive with objective.name=dpo")

    def describe(self) -> str:
        knobs = f"loss_type {self.loss_type}, beta {self.beta:g}"
        if self.loss_type in ("robust", "simpo") and self.label_smoothing:
            knobs += f", label_smoothing {self.label_smoothing:g}"
        if self.loss_type == "simpo":
            knobs += f", simpo_gamma {self.simpo_gamma:g}"
        return f"{self.name} ({knobs})"

    @property
    def needs_reference(self) -> bool:
        return self.loss_type not in REFERENCE_FREE

    def check(self, job: DictConfig) -> None:
        data = str(job.data.name)
        if data not in PREFERENCE_DATA:
            raise ConfigError(f"objective.name=dpo trains on preference pairs, but data.name={data} yields "
                              "plain rows: choose data=preference (data.path=...) or data=preference_sample")
        batch = int(job.training.local_batch_size)
        if batch % 2:
            raise ConfigError(f"training.local_batch_size={batch} must be even with objective.name=dpo "
                              "(each pair is a chosen and a rejected row of one batch)")
        if int(job.parallelism.pp) > 1:
            raise ConfigError(f"parallelism.pp={job.parallelism.pp}: objective.name=dpo needs the whole pair's "
                              "log-probs in one place (the policy's and the reference's); use FSDP/TP without PP")
        pref = job.data.get("preference") if hasattr(job.data, "get") else None
        if pref is not None and pref.get("overlong") == "error":  # every pair must fit: checked now
            from titan_plugins.data import preference_source as source

            check = source.check_preference_sample if data == "preference_sample" else source.check_preference
            check(job.data, int(job.training.seq_len))
        if self.loss_type != "robust" and self.label_smoothing and self.loss_type != "simpo":
            raise ConfigError(f"objective.label_smoothing={self.label_smoothing} is used by loss_type robust "
                              f"and simpo only (objective.loss_type={self.loss_type})")

    def count(self, labels: torch.Tensor) -> torch.Tensor:
        """Pairs, and (for ORPO's SFT term) the chosen completion tokens."""
        chosen, _ = _halves(labels)
        pairs = labels.shape[0] // 2 if owns_rows() else 0  # cp: the group's rank 0 counts the pairs
        return torch.stack([torch.tensor(pairs, device=labels.device), (chosen != IGNORE_INDEX).sum()])

    def empty_message(self, job: DictConfig) -> str:
        return f"data.name={job.data.name}: a global batch holds no preference pair"

    def reference_stats(self, output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return sequence_logps(output, labels)[0]

    def loss(self, output: torch.Tensor, labels: torch.Tensor, *, scale: Any,
             reference: Any = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        pairs, chosen_tokens = scale
        nll = _nll(output, labels)
        logps, lengths = sequence_logps(output, labels, nll)
        chosen, rejected = _halves(logps)
        chosen_len, rejected_len = _halves(lengths)
        ref_c, ref_r = _halves(reference) if reference is not None else (None, None)
        losses, r_c, r_r = pair_losses(
            self.loss_type, beta=self.beta, label_smoothing=self.label_smoothing, simpo_gamma=self.simpo_gamma,
            chosen=chosen, rejected=rejected, chosen_len=chosen_len, rejected_len=rejected_len,
            ref_chosen=ref_c, ref_rejected=ref_r)
        # Under cp every rank of the group has the whole rows' terms: one reports them (the
        # others' 0 x loss still runs backward, through row_sum, to their tokens).
        owner = 1.0 if owns_rows() else 0.0
        loss = losses.sum() / pairs * owner
        stats = {
            "rewards/chosen": r_c.sum(), "rewards/rejected": r_r.sum(),
            "rewards/accuracies": (r_c > r_r).float().sum(), "rewards/margins": (r_c - r_r).sum(),
            "logps/chosen": chosen.detach().sum(), "logps/rejected": rejected.detach().sum(),
        }
        stats = {k: v * owner for k, v in stats.items()}
        if self.loss_type == "orpo":
            sft = _halves(nll)[0].sum() / chosen_tokens  # the chosen tokens' mean NLL
            loss = loss + sft
            stats["nll_loss"] = sft.detach() * chosen_tokens  # a sum: metrics() divides by the tokens
        return loss, stats

    def metrics(self, sums: dict[str, float], count: Any) -> dict[str, float]:
        pairs, chosen_tokens = count
        out = {k: v / pairs for k, v in sums.items() if k != "nll_loss"}
        if "nll_loss" in sums:
            out["nll_loss"] = sums["nll_loss"] / chosen_tokens
        return out

    def validation_metrics(self, loss: float, sums: dict[str, float], count: Any) -> dict[str, float]:
        return {"loss": loss, **self.metrics(sums, count), "pairs": count[0]}
