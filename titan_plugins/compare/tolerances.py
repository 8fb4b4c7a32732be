"""The tolerance policy: what must be bitwise equal and what may differ by float
reordering. Stated once here; docs/compare.md explains it and the tests use it.

Bitwise on CPU/gloo fp32 (measured; see DESIGN.md platform notes):
  - a repeat run of the same configuration and seed;
  - a resumed run against the uninterrupted run;
  - FSDP on 2 ranks against one rank with 2 gradient-accumulation microbatches
    (same global batch, same order of the per-microbatch sums): losses and final
    parameters. Not the gradient norm: FSDP sums squares per shard, then across
    ranks (measured ~3e-6 relative), so compare it with GRAD_NORM_PARITY there.

Equal up to float reordering (sums done in another order):
  - FSDP reduce-scatter vs one rank (gradient sums split across ranks);
  - TP partial sums (row-wise linears reduce over ranks);
  - loss parallel (the softmax denominator is reduced over vocab shards);
  - EP token dispatch (experts see tokens in another order).
  Measured: single rank vs FSDP or TP agree to about 5e-7 in the loss over a few
  fp32 steps; MoE routing can amplify a last-bit difference when two expert scores
  tie closely, so the parity tolerance leaves two orders of magnitude of room.

Over a run: at step 1 both sides hold the same weights and batch, so the tolerance
applies as stated; from step 2 on each side's weights carry its own reordering, and
the allowed difference at step N is N times step 1's (``Tolerance.allowed``). The
gradient norm is far more sensitive to the weights than the loss: measured with qwen3's
debugmodel, one rank against FSDP on 2 ranks, the loss agreed to 2.4e-6 for 8 steps
and the norm to 4e-5 for 7, then to 2.4e-3 at step 8 (a jump of the norm from 1.5 to
3.8); from the same step-7 weights both layouts give step 8's norm to 2.7e-5.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Tolerance:
    """``|test - baseline| <= atol + rtol * |baseline|`` at step 1, ``step`` times that
    at a later step (see the module's docstring: the sides' weights drift apart)."""

    rtol: float
    atol: float

    def allowed(self, baseline: float, step: int = 1) -> float:
        """The largest difference allowed at ``step`` (1-based; 1 for a single value)."""
        return max(step, 1) * (self.atol + self.rtol * abs(baseline))

    def allows(self, baseline: float, test: float, step: int = 1) -> bool:
        return abs(test - baseline) <= self.allowed(baseline, step)


BITWISE = Tolerance(rtol=0.0, atol=0.0)
# Loss parity between parallelisms in fp32 (the project's tests and titan-compare's default).
LOSS_PARITY = Tolerance(rtol=1e-4, atol=1e-5)
# Gradient norms are a sum of squares over every parameter: a little looser.
GRAD_NORM_PARITY = Tolerance(rtol=1e-3, atol=1e-5)
# Final parameters after a few steps of AdamW (max abs difference of full tensors).
PARAM_PARITY = Tolerance(rtol=0.0, atol=1e-4)
# bf16 compute against fp32 compute (numerics tests, not parallelism parity).
BF16_COMPUTE = Tolerance(rtol=2e-2, atol=2e-2)
