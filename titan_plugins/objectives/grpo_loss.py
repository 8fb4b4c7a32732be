"""The arithmetic of ``objective=grpo``, as TRL 1.16's GRPOTrainer does it
(``_generate_and_score_completions`` for the advantages, ``_compute_loss`` for the loss).

Advantages (TRL's ``sum_then_normalize``): a completion's reward is the weighted sum of
its reward functions' values (NaN ones, a function's None, left out; a completion every
function skipped is unscorable: NaN, then advantage 0); the advantage is the reward minus
its group's mean (the ``num_generations`` completions of one prompt), divided by
``std + 1e-4`` where ``std`` is the group's sample standard deviation (``scale_rewards=
group``), the whole generation batch's (``batch``) or nothing (``none``).

Per token (``t`` in the completion, the EOS included): ``log_ratio = logp - old_logp``
(``old`` the log-probs of the policy that sampled; with ``num_iterations=1`` the
current ones detached, so the ratio is exactly 1); the importance weight ``w = exp``
of it per token, or of its mean over the completion (``importance_sampling_level=
sequence``, GSPO); ``loss_t = -min(w A, clip(w, 1 - epsilon, 1 + epsilon_high) A)``,
plus ``beta (exp(r) - r - 1)`` with ``r = ref_logp - logp`` (the k3 estimator of the KL
to the reference; times ``w`` with ``use_bias_correction_kl``, TRL's default) when ``beta > 0``. Normalisers (:func:`reduce_loss`): ``grpo`` each
completion's token mean, averaged over completions; ``dapo`` the sum over the global
batch's completion tokens; ``dr_grpo`` the sum over completions times
``max_completion_length``; ``bnpo`` each microbatch's token mean, averaged over the
microbatches (TRL's local batch, so it depends on the layout as TRL's does).
"""

from __future__ import annotations

import torch

from titan_plugins.components.cp_attention import row_sum

__all__ = ["IS_LEVELS", "LOSS_TYPES", "SCALE_REWARDS", "advantages", "nanstd", "per_token_loss", "reduce_loss",
           "rollout_metrics"]

LOSS_TYPES = ("grpo", "dapo", "dr_grpo", "bnpo")
SCALE_REWARDS = ("group", "batch", "none")
IS_LEVELS = ("token", "sequence")


def nanstd(x: torch.Tensor, dim: int | None = None, keepdim: bool = False) -> torch.Tensor:
    """The sample standard deviation ignoring NaNs (Bessel's correction; NaN below 2 values): TRL's."""
    mean = torch.nanmean(x, dim=dim, keepdim=True)
    variance = torch.nanmean((x - mean) ** 2, dim=dim, keepdim=True)
    count = torch.sum(~torch.isnan(x), dim=dim, keepdim=True)
    correction = torch.where(count > 1, count / (count - 1), torch.full_like(variance, float("nan")))
    std = torch.sqrt(variance * correction)
    return std if keepdim else std.squeeze(dim) if dim is not None else std.reshape(())


def advantages(rewards_per_func: torch.Tensor, weights: torch.Tensor, num_generations: int,
               scale_rewards: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(advantages [N], rewards [N] (NaN where unscorable), is_std_zero [N])`` of the
    whole generation batch's ``rewards_per_func [N, F]`` (groups of ``num_generations``
    consecutive rows)."""
    unscorable = torch.isnan(rewards_per_func).all(dim=1)
    rewards = (rewards_per_func * weights.unsqueeze(0)).nansum(dim=1)
    rewards[unscorable] = torch.nan
    grouped = rewards.view(-1, num_generations)
    mean = torch.nanmean(grouped, dim=1).repeat_interleave(num_generations, dim=0)
    if scale_rewards == "batch":
        std = nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
    else:  # group, and none (where it only says which groups have one reward)
        std = nanstd(grouped, dim=1).repeat_interleave(num_generations, dim=0)
    adv = rewards - mean
    if scale_rewards != "none":
        adv = adv / (std + 1e-4)
    is_std_zero = torch.isclose(std, torch.zeros_like(std))
    return torch.nan_to_num(adv, nan=0.0), rewards, is_std_zero


def rollout_metrics(names: list[str], rewards_per_func: torch.Tensor, rewards: torch.Tensor,
                    is_std_zero: torch.Tensor, lengths: torch.Tensor, truncated: torch.Tensor) -> dict[str, float]:
    """What TRL logs of a generation batch: ``rewards/<name>/mean|std``, ``reward``,
    ``reward_std``, ``frac_reward_zero_std``, ``completions/*``."""
    out: dict[str, float] = {}
    for i, name in enumerate(names):
        out[f"rewards/{name}/mean"] = torch.nanmean(rewards_per_func[:, i]).item()
        out[f"rewards/{name}/std"] = nanstd(rewards_per_func[:, i]).item()
    out["reward"] = torch.nanmean(rewards).item()
    out["reward_std"] = nanstd(rewards).item()
    out["frac_reward_zero_std"] = is_std_zero.float().mean().item()
    lengths = lengths.float()
    out["completions/mean_length"] = lengths.mean().item()
    out["completions/min_length"] = lengths.min().item()
    out["completions/max_length"] = lengths.max().item()
    out["completions/clipped_ratio"] = truncated.float().mean().item()
    terminated = lengths[~truncated]
    if terminated.numel() == 0:
        terminated = torch.zeros(1)
    out["completions/mean_terminated_length"] = terminated.mean().item()
    out["completions/min_terminated_length"] = terminated.min().item()
    out["completions/max_terminated_length"] = terminated.max().item()
    return out


def per_token_loss(logps: torch.Tensor, old_logps: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, *,
                   level: str, epsilon_low: float, epsilon_high: float, beta: float,
                   ref_logps: torch.Tensor | None = None, bias_correction_kl: bool = True,
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(per-token loss, importance weight, per-token KL or None)``; the weight and the
    loss are ``[B, 1]`` at the sequence level (broadcast against the mask later).
    ``bias_correction_kl`` (TRL's ``use_bias_correction_kl``, on by default there) weights
    the KL by the importance weight (DeepSeek-V3.2's unbiased reverse-KL gradient)."""
    adv = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages
    log_ratio = logps - old_logps
    if level == "token":
        log_weights = log_ratio
    else:  # row_sum: under context parallel a row's tokens are on several ranks
        log_weights = (row_sum((log_ratio * mask).sum(-1)) / row_sum(mask.sum(-1)).clamp(min=1.0)).unsqueeze(-1)
    coef_1 = torch.exp(log_weights)
    kl = None
    if beta != 0.0:
        assert ref_logps is not None, "beta > 0 needs the reference's log-probs"
        kl = torch.exp(ref_logps - logps) - (ref_logps - logps) - 1
        if bias_correction_kl:
            kl = kl * coef_1
    coef_2 = torch.clamp(coef_1, 1 - epsilon_low, 1 + epsilon_high)
    loss = -torch.min(coef_1 * adv, coef_2 * adv)
    if kl is not None:
        loss = loss + beta * kl
    return loss, coef_1, kl


def reduce_loss(loss_type: str, per_token: torch.Tensor, mask: torch.Tensor, *, rows: float, tokens: float,
                microbatches: float, max_completion_length: int) -> torch.Tensor:
    """This microbatch's share of the global loss (the sum over microbatches and ranks is
    the loss TRL's accumulated, data-parallel step minimises). Under context parallel the
    per-row and per-microbatch token counts are the whole rows' (``row_sum``), and each
    rank's share is its own tokens' part."""
    masked = per_token * mask
    if loss_type == "grpo":
        return (masked.sum(-1) / row_sum(mask.sum(-1)).clamp(min=1.0)).sum() / rows
    if loss_type == "bnpo":
        return masked.sum() / row_sum(mask.sum()).clamp(min=1.0) / microbatches
    if loss_type == "dr_grpo":
        return masked.sum() / (rows * max_completion_length)
    if loss_type == "dapo":
        return masked.sum() / max(tokens, 1.0)
    raise ValueError(f"unknown loss_type {loss_type!r}")
