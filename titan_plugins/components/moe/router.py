"""Token-choice top-k router (TorchTitan's ``TokenChoiceTopKRouter`` numerics)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from titan_plugins.components.compute_dtype import cast
from titan_plugins.components.init import trunc_normal_
from titan_plugins.components.moe.config import ScoreFunc


class TokenChoiceTopKRouter(nn.Module):
    """Scores every token against ``gate`` (``Linear(dim, num_experts)``, no bias) in
    float32, picks ``top_k`` experts per token, optionally among the
    ``num_limited_groups`` best of ``num_expert_groups`` groups (node-limited routing).

    ``expert_bias`` shifts the *selection* only; the gating weights come from the
    unbiased scores, optionally normalised (``route_norm``) and scaled (``route_scale``).
    """

    lora_uncalled = ("gate",)  # its weight is read, never called: LoRA leaves it (titan_plugins/peft)

    def __init__(
        self,
        dim: int,
        num_experts: int,
        num_expert_groups: int | None,
        num_limited_groups: int | None,
        top_k: int,
        score_func: ScoreFunc | str,
        route_norm: bool,
        route_scale: float,
        compute_dtype: torch.dtype | None = None,
    ):
        super().__init__()
        self.gate = nn.Linear(dim, num_experts, bias=False)
        self.num_experts = num_experts
        self.num_expert_groups = num_expert_groups
        self.num_limited_groups = num_limited_groups
        self.top_k = top_k
        self.score_func = ScoreFunc(score_func)
        self.route_norm = route_norm
        self.route_scale = route_scale
        self.compute_dtype = compute_dtype

    def scores(self, x: torch.Tensor, gate_weight: torch.Tensor | None = None) -> torch.Tensor:
        """float32 router probabilities, shape ``(tokens, num_experts)``."""
        weight = self.gate.weight if gate_weight is None else gate_weight
        dtype = self.compute_dtype
        logits = F.linear(cast(x, dtype), cast(weight, dtype)).to(torch.float32)
        if self.score_func is ScoreFunc.sigmoid:
            return torch.sigmoid(logits)
        return F.softmax(logits, dim=-1)

    def _limit_groups(self, scores_for_choice: torch.Tensor) -> torch.Tensor:
        """Keep the ``num_limited_groups`` groups with the best top-2 sums; -inf elsewhere."""
        groups = self.num_expert_groups
        grouped = scores_for_choice.view(-1, groups, self.num_experts // groups)
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
        group_idx = group_scores.topk(self.num_limited_groups, dim=-1, sorted=False).indices
        dropped = torch.ones_like(group_scores, dtype=torch.bool).scatter_(1, group_idx, False)
        return grouped.masked_fill(dropped.unsqueeze(-1), float("-inf")).view(-1, self.num_experts)

    def forward(
        self,
        x: torch.Tensor,
        expert_bias: torch.Tensor | None = None,
        gate_weight: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x``: ``(tokens, dim)``; ``gate_weight`` overrides ``gate.weight`` (a local
        tensor under parallelism). Returns ``top_scores`` (float32, ``(tokens, top_k)``),
        ``selected_experts_indices`` (int64, ``(tokens, top_k)``) and
        ``num_tokens_per_expert`` (int64, ``(num_experts,)``)."""
        scores = self.scores(x, gate_weight)
        return self.select(scores, expert_bias)

    def select(
        self, scores: torch.Tensor, expert_bias: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        choice = scores if expert_bias is None else scores + expert_bias
        if self.num_expert_groups is not None:
            choice = self._limit_groups(choice)
        selected = torch.topk(choice, k=self.top_k, dim=-1, sorted=False).indices
        top_scores = scores.gather(dim=1, index=selected)
        if self.route_norm:
            top_scores = top_scores / (top_scores.sum(dim=-1, keepdim=True) + 1e-20)
        top_scores = top_scores * self.route_scale
        counts = torch.bincount(selected.view(-1), minlength=self.num_experts)
        return top_scores, selected, counts

    def init_weights(self, init_std: float) -> None:
        trunc_normal_(self.gate.weight, mean=0.0, std=init_std)
