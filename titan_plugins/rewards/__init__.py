"""Rewards for online objectives (``objective=grpo``): functions with TRL's signature
``reward(prompts, completions, completion_ids, **columns) -> list[float | None]``, so a
reward written for TRL's GRPOTrainer works unchanged. The core ships ``accuracy``,
``format`` and ``length`` (``titan_plugins.rewards.builtin``) and ``reward_model``, a
Hugging Face sequence-classification folder scored as TRL scores a reward model
(``titan_plugins.rewards.reward_model``); an installed distribution adds one under the
entry-point group ``titan_plugins.rewards``. Importing this package is light (no torch)."""

from __future__ import annotations

from titan_plugins.rewards.registry import (
    BUILTIN_REWARDS,
    ENTRY_POINT_GROUP,
    RewardRegistry,
    discover,
    load_rewards,
)

__all__ = ["BUILTIN_REWARDS", "ENTRY_POINT_GROUP", "RewardRegistry", "discover", "load_rewards"]
