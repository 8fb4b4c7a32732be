"""What a DPO run (``objective=dpo``) logs at initialisation, for tests: the policy is
its reference there, so step 1's sigmoid loss is exactly :data:`LN2` (ln 2 in float32,
as the run computes it) and every one of :data:`REWARDS` is 0."""

from __future__ import annotations

import math

import torch

__all__ = ["LN2", "REWARDS"]

LN2 = torch.tensor(math.log(2), dtype=torch.float32).item()
REWARDS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins")  # objectives/dpo.py's
