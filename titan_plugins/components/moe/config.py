"""MoE configuration: a torch-free structured schema (safe inside Hydra schemas).

Field names mirror TorchTitan 0.2.2's ``MoEArgs`` (minus its debug-only
``_debug_force_load_balance`` and ``gate_bias``, which no first-party model uses).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from titan_plugins.errors import ConfigError


class ScoreFunc(str, Enum):
    softmax = "softmax"
    sigmoid = "sigmoid"


@dataclass
class MoEConfig:
    num_experts: int = 8
    num_shared_experts: int = 1  # shared SwiGLU of hidden_dim * num_shared_experts; 0 = none

    # router
    score_func: ScoreFunc = ScoreFunc.sigmoid
    route_norm: bool = False  # divide the top-k scores by their sum
    route_scale: float = 1.0
    score_before_experts: bool = True  # scale expert inputs (True) or outputs (False)

    # token-choice top-k with optional node-limited (grouped) routing
    num_expert_groups: int | None = None  # a divisor of num_experts
    num_limited_groups: int | None = None  # groups kept per token; needs num_expert_groups
    use_grouped_mm: bool = True  # torch._grouped_mm where available, else a per-expert loop
    top_k: int = 1

    # auxiliary-loss-free load balancing (None = off); optional sequence-wise aux loss
    load_balance_coeff: float | None = 1e-3
    seq_aux_loss_coeff: float = 0.0

    def validate(self, *, key: str = "moe") -> None:
        """Raise ConfigError naming the numbers that disagree; ``key`` is where this
        config sits in the job (``model.moe``, ``model.layer.moe``)."""
        if self.num_experts < 1:
            raise ConfigError(f"{key}.num_experts={self.num_experts} must be >= 1")
        if not 1 <= self.top_k <= self.num_experts:
            raise ConfigError(
                f"{key}.top_k={self.top_k} must be in [1, num_experts={self.num_experts}]"
            )
        if self.num_shared_experts < 0:
            raise ConfigError(f"{key}.num_shared_experts={self.num_shared_experts} must be >= 0")
        if self.load_balance_coeff is not None and self.load_balance_coeff <= 0:
            raise ConfigError(
                f"{key}.load_balance_coeff={self.load_balance_coeff} must be > 0 or None"
            )
        if self.seq_aux_loss_coeff < 0:
            raise ConfigError(f"{key}.seq_aux_loss_coeff={self.seq_aux_loss_coeff} must be >= 0")
        if self.num_expert_groups is not None:
            groups = self.num_expert_groups
            if self.num_experts % groups:
                raise ConfigError(
                    f"{key}.num_experts={self.num_experts} is not divisible by "
                    f"{key}.num_expert_groups={groups}"
                )
            if self.num_experts // groups < 2:
                raise ConfigError(
                    f"{key}.num_experts={self.num_experts} / {key}.num_expert_groups={groups} "
                    "must leave at least 2 experts per group"
                )
            if self.num_limited_groups is None or not 1 <= self.num_limited_groups <= groups:
                raise ConfigError(
                    f"{key}.num_limited_groups={self.num_limited_groups} must be in "
                    f"[1, num_expert_groups={groups}]"
                )
            if self.top_k > self.num_limited_groups * (self.num_experts // groups):
                raise ConfigError(
                    f"{key}.top_k={self.top_k} exceeds the experts left by "
                    f"{key}.num_limited_groups={self.num_limited_groups}"
                )
        elif self.num_limited_groups is not None:
            raise ConfigError(f"{key}.num_limited_groups needs {key}.num_expert_groups")
