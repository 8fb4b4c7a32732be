"""objective=grpo with beta > 0 (titan-run, one rank): the KL to the reference, through the
same reference machinery as DPO (LoRA: the base with the adapters off; full fine-tuning:
a frozen copy of the starting weights). At step 1 the policy is the reference, so ``kl``
is exactly 0; after an update it is positive. (Equality with TRL's KL term, each loss
type: tests/test_grpo_loss.py.)"""

from __future__ import annotations

import pytest

from titan_plugins.testing.grpo import launch_grpo, tiny_grpo_run

pytest.importorskip("titan_qwen3")
pytestmark = pytest.mark.slow  # launched runs

TINY = [*tiny_grpo_run(max_completion_length=8, local_batch_size=2, lr=0.05), "objective.beta=0.04"]


@pytest.mark.parametrize("peft", ["lora", "none"])
def test_the_kl_to_the_reference_starts_at_zero_and_grows(tmp_path, peft):
    records, _ = launch_grpo(tmp_path / peft, [*TINY, f"peft={peft}"], timeout=300)
    assert records[0]["kl"] == 0.0 and records[0]["clip_ratio/region_mean"] == 0.0
    assert records[1]["kl"] > 0.0
