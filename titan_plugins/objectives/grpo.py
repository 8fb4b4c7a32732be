"""``objective=grpo``: online RL with verifiable rewards (GRPO, DAPO, Dr. GRPO, BNPO,
GSPO), as TRL 1.16's GRPOTrainer computes it.

A step: the rollout stage (``rollout``, before the microbatches; ``grpo_stage.py``)
samples ``num_generations`` completions of each of the step's prompts, scores them with
the reward functions (``titan_plugins.rewards``), turns the rewards into group-normalised
advantages and lays ``prompt + completion`` out as the rows the microbatches train on;
then each microbatch's ``loss`` is the clipped surrogate of ``grpo_loss.py`` with the
chosen normaliser. The knobs are TRL's GRPOConfig's (``objective.*``); what it cannot
train is refused before launch in one line (``check``).

Metrics (TRL's names): the rollout's ``reward``, ``reward_std``, ``rewards/<name>/mean``
and ``/std``, ``frac_reward_zero_std``, ``completions/*``; the loss's ``entropy``,
``kl`` (``beta > 0``) and ``clip_ratio/*``, each the mean over the step's microbatches of
its value over the data-parallel ranks (TRL's ``global_masked_mean`` per microbatch,
averaged over the accumulation steps as TRL's logging averages them); and the rollout's
``time/generation_s`` and ``time/scoring_s``.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from titan_plugins.errors import ConfigError
from titan_plugins.loss.token_loss import IGNORE_INDEX
from titan_plugins.objectives.base import Objective
from titan_plugins.objectives.grpo_loss import (
    IS_LEVELS,
    LOSS_TYPES,
    SCALE_REWARDS,
    per_token_loss,
    reduce_loss,
)

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from titan_plugins.objectives.job import JobView

__all__ = ["GRPOObjective"]

PROMPT_DATA = ("prompts",)
STATS = ("kl", "entropy", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")


def _plain(value: Any) -> Any:
    from omegaconf import DictConfig, ListConfig, OmegaConf

    return OmegaConf.to_container(value, resolve=True) if isinstance(value, DictConfig | ListConfig) else value


def _choice(key: str, value: str, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise ConfigError(f"objective.{key}={value}: expected one of {', '.join(allowed)}")
    return value


class GRPOObjective(Objective):
    """The GRPO family (module docstring); knobs from ``objective.*``."""

    def __init__(self, config: Any = None, spec: Any = None) -> None:
        super().__init__(config, spec)
        get = (lambda k, d: _plain(getattr(config, k, d))) if config is not None else (lambda k, d: d)
        self.loss_type = _choice("loss_type", str(get("loss_type", "dapo")), LOSS_TYPES)
        self.scale_rewards = _choice("scale_rewards", str(get("scale_rewards", "group")), SCALE_REWARDS)
        self.importance_sampling_level = _choice("importance_sampling_level",
                                                 str(get("importance_sampling_level", "token")), IS_LEVELS)
        self.beta = float(get("beta", 0.0))
        self.num_generations = int(get("num_generations", 8))
        self.max_completion_length = int(get("max_completion_length", 64))
        self.temperature = float(get("temperature", 1.0))
        self.top_p, self.top_k = float(get("top_p", 1.0)), int(get("top_k", 0))
        self.epsilon_low = float(get("epsilon", 0.2))
        high = get("epsilon_high", None)
        self.epsilon_high = self.epsilon_low if high is None else float(high)
        self.num_iterations = int(get("num_iterations", 1))
        self.mask_truncated_completions = bool(get("mask_truncated_completions", False))
        self.use_bias_correction_kl = bool(get("use_bias_correction_kl", True))
        self.reward_names = [str(n) for n in (get("reward_funcs", None) or [])]
        weights = get("reward_weights", None)
        self.reward_weights = [1.0] * len(self.reward_names) if weights is None else [float(w) for w in weights]
        self.reward_options = dict(get("reward_options", None) or {})
        if self.num_generations < 2:
            raise ConfigError(f"objective.num_generations={self.num_generations}: a group needs at least 2 "
                              "completions (the advantage compares them)")
        if not self.reward_names:
            raise ConfigError("objective.reward_funcs=[]: objective.name=grpo needs at least one reward "
                              "(e.g. objective.reward_funcs=[accuracy]; titan-plugins list shows them)")
        if len(self.reward_weights) != len(self.reward_names):
            raise ConfigError(f"objective.reward_weights={self.reward_weights}: {len(self.reward_weights)} weights "
                              f"for {len(self.reward_names)} rewards (objective.reward_funcs={self.reward_names})")
        self.rewards: list[tuple[str, Any]] | None = None  # loaded when first needed (titan_plugins.rewards)
        self.group: Any = None  # the data-parallel group of the job (set by the rollout stage)
        self.stage: Any = None  # grpo_stage.RolloutStage, built at the first rollout
        self.rollout_metrics: dict[str, float] = {}

    # ------------------------------------------------------------------ what it is
    def describe(self) -> str:
        eps = (f"{self.epsilon_low:g}" if self.epsilon_high == self.epsilon_low
               else f"{self.epsilon_low:g}/{self.epsilon_high:g}")
        rewards = ", ".join(f"{n} x{w:g}" for n, w in zip(self.reward_names, self.reward_weights))
        return (f"{self.name} (loss_type {self.loss_type}, num_generations {self.num_generations}, "
                f"max_completion_length {self.max_completion_length}, beta {self.beta:g}, epsilon {eps}, "
                f"scale_rewards {self.scale_rewards}, importance_sampling_level {self.importance_sampling_level}, "
                f"num_iterations {self.num_iterations}, temperature {self.temperature:g}; rewards {rewards})")

    @property
    def needs_reference(self) -> bool:
        return self.beta != 0.0

    def load_rewards(self, device: str | None = None) -> list[tuple[str, Any]]:
        """``[(name, function)]``, options bound (``length`` defaults to ``max_completion_length``,
        ``reward_model`` to ``device``, the rank's own, where it is given; the first call binds)."""
        if self.rewards is None:
            from titan_plugins.rewards import load_rewards

            options = {str(k): dict(v or {}) for k, v in self.reward_options.items()}
            if "length" in self.reward_names:
                options.setdefault("length", {}).setdefault("max_completion_len", self.max_completion_length)
            if "reward_model" in self.reward_names and device is not None:
                options.setdefault("reward_model", {}).setdefault("device", device)
            self.rewards = load_rewards(self.reward_names, options)
        return self.rewards

    def check(self, job: DictConfig) -> None:
        data = str(job.data.name)
        if data not in PROMPT_DATA:
            raise ConfigError(f"objective.name=grpo samples completions of prompts, but data.name={data} yields "
                              "token rows: choose data=prompts (data.path=...; without it the shipped arithmetic task)")
        par = job.parallelism
        if int(par.pp) > 1:
            raise ConfigError(f"parallelism.pp={par.pp}: objective.name=grpo decodes with the whole model on each "
                              "rank (the KV cache); use FSDP/HSDP without PP")
        if job.validation.enabled:
            raise ConfigError("validation.enabled=true: objective.name=grpo has no held-out loss (its rows are "
                              "sampled each step); read the rewards in metrics.jsonl and completions.jsonl")
        if job.objective.get("precompute_ref"):
            raise ConfigError("objective.precompute_ref=true: objective.name=grpo's completions are sampled each "
                              "step, so the reference's log-probs cannot be computed before training")
        seq_len = int(job.training.seq_len)
        if self.max_completion_length >= seq_len:
            raise ConfigError(f"objective.max_completion_length={self.max_completion_length} leaves no room for a "
                              f"prompt in training.seq_len={seq_len} (a row holds prompt + completion)")
        from titan_plugins.objectives.rollout import build_engine

        self.load_rewards()  # unknown names and broken reward packages: one line now
        build_engine(job, self)  # rollout=file: the file exists and parses
        from titan_plugins.data.prompt_source import PromptDataset
        from titan_plugins.data.tokenizer import build_tokenizer

        room = seq_len + 1 - self.max_completion_length
        dataset = PromptDataset(job.data, build_tokenizer(job.data), dp_rank=0, dp_world=1, seq_len=1 << 30, seed=0)
        for position in range(min(len(dataset), 2000)):
            row = dataset.prompt_row(position)
            if len(row.ids) > room:
                raise ConfigError(f"{row.where}: the prompt is {len(row.ids)} tokens; with objective."
                                  f"max_completion_length={self.max_completion_length} a row needs "
                                  f"{len(row.ids) + self.max_completion_length - 1} positions, over "
                                  f"training.seq_len={seq_len}")

    # ------------------------------------------------------------------ the step
    def rollout(self, run: JobView, step: int, batches: list[Any]) -> list[Any]:
        """The step's rows: the prompts' completions, scored (``grpo_stage.RolloutStage``)."""
        from titan_plugins.objectives.grpo_stage import RolloutStage
        from titan_plugins.objectives.rollout import rollout_group

        self.group = rollout_group(run)
        if self.stage is None:
            self.stage = RolloutStage(run, self)
        out, self.rollout_metrics = self.stage(run, step, batches)
        return out

    def count(self, labels: torch.Tensor) -> torch.Tensor:
        """Completions, completion tokens (the loss mask), and one microbatch (rows and
        microbatches counted by one rank of a cp group: ``owns_rows``)."""
        from titan_plugins.components.cp_attention import owns_rows

        once = 1 if owns_rows() else 0
        return torch.stack([torch.tensor(labels.shape[0] * once, device=labels.device),
                            (labels != IGNORE_INDEX).sum(), torch.tensor(once, device=labels.device)])

    def empty_message(self, job: DictConfig) -> str:
        return f"data.name={job.data.name}: a global batch holds no completion"

    def reference_stats(self, output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        from titan_plugins.loss.token_logps import token_logps

        return token_logps(output, labels, self.temperature)[0]

    def loss_inputs(self, batch: Any) -> dict[str, Any]:
        return {"rollout": batch}

    def loss(self, output: torch.Tensor, labels: torch.Tensor, *, scale: Any, reference: Any = None,
             rollout: Any = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        from titan_plugins.loss.token_logps import token_logps

        rows, tokens, microbatches = scale
        logps, entropy = token_logps(output, labels, self.temperature)
        mask = (labels != IGNORE_INDEX).to(logps.dtype)
        old = rollout.old_logps
        old = logps.detach() if old is None else old.to(logps.device)
        advantages = rollout.advantages.to(logps.device)
        per_token, coef, kl = per_token_loss(
            logps, old, advantages, mask, level=self.importance_sampling_level, epsilon_low=self.epsilon_low,
            epsilon_high=self.epsilon_high, beta=self.beta, ref_logps=reference,
            bias_correction_kl=self.use_bias_correction_kl)
        loss = reduce_loss(self.loss_type, per_token, mask, rows=rows, tokens=tokens, microbatches=microbatches,
                           max_completion_length=self.max_completion_length)
        return loss, self._stats(mask, entropy.detach(), None if kl is None else kl.detach(), coef.detach(),
                                 advantages.unsqueeze(1))

    def _stats(self, mask: torch.Tensor, entropy: torch.Tensor, kl: torch.Tensor | None, coef: torch.Tensor,
               adv: torch.Tensor) -> dict[str, torch.Tensor]:
        """This microbatch's metrics over every data-parallel rank (TRL's ``global_masked_mean``,
        ``nanmin``/``nanmax`` of the per-completion clip fractions). Under context parallel
        the sums run over ``dp x cp``, per-completion values over the whole row
        (``row_sum``), and one rank of each cp group reports them (``owns_rows``)."""
        from titan_plugins.components.cp_attention import owns_rows, row_sum

        low = ((coef < 1 - self.epsilon_low) & (adv < 0)).to(mask.dtype)
        high = ((coef > 1 + self.epsilon_high) & (adv > 0)).to(mask.dtype)
        region = torch.maximum(low, high)
        tokens = mask.sum()
        once = 1.0 if owns_rows() else 0.0
        if coef.shape[1] == 1:  # sequence level: one value per completion (the same on a row's cp ranks)
            clip_sum = [x.sum() * once for x in (low, high, region)]
            clip_count = torch.tensor(float(coef.shape[0]) * once, device=mask.device)
            low_rows, high_rows = low.squeeze(1), high.squeeze(1)
        else:
            clip_sum = [(x * mask).sum() for x in (low, high, region)]
            clip_count = tokens
            per_row = row_sum(mask.sum(-1))
            low_rows, high_rows = row_sum((low * mask).sum(-1)) / per_row, row_sum((high * mask).sum(-1)) / per_row
        kl_sum = (kl * mask).sum() if kl is not None else torch.zeros((), device=mask.device)
        sums = torch.stack([kl_sum, (entropy * mask).sum(), *clip_sum, tokens, clip_count]).double()
        inf = torch.tensor(math.inf, dtype=torch.float64, device=mask.device)
        low_min = low_rows[~torch.isnan(low_rows)].double().min() if bool((~torch.isnan(low_rows)).any()) else inf
        high_max = high_rows[~torch.isnan(high_rows)].double().max() if bool((~torch.isnan(high_rows)).any()) else -inf
        extremes = torch.stack([low_min, -high_max])
        if self.group is not None:
            dist.all_reduce(sums, group=self.group)
            dist.all_reduce(extremes, op=dist.ReduceOp.MIN, group=self.group)
        tok, cc = sums[5].clamp(min=1.0), sums[6].clamp(min=1.0)
        nan = torch.tensor(math.nan, dtype=torch.float64, device=mask.device)
        out = {"entropy": sums[1] / tok, "clip_ratio/low_mean": sums[2] / cc, "clip_ratio/high_mean": sums[3] / cc,
               "clip_ratio/region_mean": sums[4] / cc,
               "clip_ratio/low_min": torch.where(torch.isinf(extremes[0]), nan, extremes[0]),
               "clip_ratio/high_max": torch.where(torch.isinf(extremes[1]), nan, -extremes[1])}
        if kl is not None:
            out["kl"] = sums[0] / tok
        if not once:  # the cp group's other ranks: their peer reports the same values
            out = {k: torch.zeros_like(v) for k, v in out.items()}
        return out

    def metrics(self, sums: dict[str, float], count: Any) -> dict[str, float]:
        """The rollout's metrics, then each loss metric's mean over the step's microbatches
        (``sums`` holds each microbatch's value over the ranks, summed over the ranks)."""
        microbatches = count[2]
        out = dict(self.rollout_metrics)
        for key in ("kl", "entropy", "clip_ratio/low_mean", "clip_ratio/low_min", "clip_ratio/high_mean",
                    "clip_ratio/high_max", "clip_ratio/region_mean"):
            if key in sums:
                out[key] = sums[key] / microbatches
        return out
