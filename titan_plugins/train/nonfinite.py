"""Non-finite steps (``training.nonfinite``): a NaN or Inf loss or gradient norm on
any rank, caught between the gradient clip and the optimizer step.

Every rank computes one number and the ranks agree through one all-reduce (MIN) of
it: ``rank`` when this rank's own loss is not finite, ``world + rank`` when only the
gradient norm is (it is the global norm, the same on every rank, so no rank can be
named), ``2 * world`` when all is well. So every rank takes the same decision and
names the same (lowest) rank.

- ``stop`` (the default): ``NonFiniteError`` before the optimizer step, so nothing
  of the step is applied or saved over the last good checkpoint; one line naming
  the step and the rank, exit 2.
- ``skip``: the optimizer step is dropped on every rank (the gradients are zeroed,
  the lr schedule moves on), the step is counted and listed in the run summary;
  one more non-finite step after ``training.nonfinite_max_skips`` skipped in a row
  stops the run as ``stop`` does.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from titan_plugins.config.schema import NonFinite as NonFinitePolicy
from titan_plugins.errors import TitanError

__all__ = ["NonFiniteError", "NonFiniteGuard", "NonFinitePolicy"]


class NonFiniteError(TitanError):
    """A non-finite step ended the run (one line naming step and rank, exit 2)."""


class NonFiniteGuard:
    """``check(step, loss, grad_norm)`` once per step on every rank, a collective."""

    def __init__(self, policy: Any, max_skips: int, *, rank: int, world: int, device: torch.device) -> None:
        self.policy = NonFinitePolicy(getattr(policy, "value", policy))
        self.max_skips, self.rank, self.world, self.device = int(max_skips), rank, world, device
        self.skipped: list[int] = []
        self.in_a_row = 0

    def _agree(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> int:
        if not math.isfinite(float(loss)):
            code = self.rank
        elif not math.isfinite(float(grad_norm)):
            code = self.world + self.rank
        else:
            code = 2 * self.world
        if dist.is_available() and dist.is_initialized() and self.world > 1:
            flag = torch.tensor([code], dtype=torch.int64, device=self.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MIN)
            code = int(flag.item())
        return code

    def check(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor) -> bool:
        """``True``: skip this step's optimizer update (every rank returns the same).
        ``loss``: this rank's own (not yet reduced) loss; ``grad_norm``: the global norm."""
        code = self._agree(loss, grad_norm)
        if code >= 2 * self.world:
            self.in_a_row = 0
            return False
        what = (f"the loss is not finite on rank {code}" if code < self.world
                else "the gradient norm is not finite (on every rank: it is the global norm)")
        if self.policy is NonFinitePolicy.stop:
            raise NonFiniteError(f"step {step}: {what}; training.nonfinite=stop ended the run before the "
                                 "optimizer step (nothing of it applied or saved; training.nonfinite=skip "
                                 "drops such steps)")
        self.in_a_row += 1
        if self.in_a_row > self.max_skips:
            raise NonFiniteError(f"step {step}: {what}, {self.in_a_row} steps in a row; "
                                 f"training.nonfinite_max_skips={self.max_skips} ended the run "
                                 f"(skipped before: {self.summary()})")
        self.skipped.append(step)
        if self.rank == 0:
            print(f"warning: step {step}: {what}: optimizer step skipped (training.nonfinite=skip, "
                  f"{self.in_a_row} in a row)", flush=True)
        return True

    def summary(self) -> str | None:
        """The skipped steps for the run summary (``None``: none)."""
        if not self.skipped:
            return None
        shown = ", ".join(map(str, self.skipped[:20])) + (", ..." if len(self.skipped) > 20 else "")
        return f"{len(self.skipped)} skipped (steps {shown})"
