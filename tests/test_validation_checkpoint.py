"""Validation x checkpointing x parallelism x resume, together (issue 25, item 1).

A forward-only validation pass left FSDP2's units that do not reshard after forward
unsharded, so the next save died in ``get_optimizer_state_dict`` (``KeyError``). Two
launches of a tiny Qwen3-MoE cover the combinations: FSDP x TP x EP validating and saving
on every step (validation and a periodic save coincide, then the final save), and a resume
of that checkpoint under FSDP x PP that validates and saves again.
"""

from __future__ import annotations

import json

import pytest

from titan_plugins.train.api import run

TINY_MOE = [
    "model=qwen3", "model.flavor=debugmodel_moe", "model.dim=32", "model.n_layers=2", "model.n_heads=4",
    "model.n_kv_heads=2", "model.head_dim=8", "model.moe_inter_dim=32", "model.moe.num_experts=4",
    "model.moe.top_k=2", "training.seq_len=16", "training.local_batch_size=2",
    "metrics.tensorboard=false", "metrics.console=false",
    "validation.enabled=true", "validation.every=1", "validation.steps=1",
    "checkpoint.enabled=true", "checkpoint.interval=1",
]  # fmt: skip


def _records(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_validation_checkpoint_and_resume_under_every_parallelism(tmp_path) -> None:
    first = run([*TINY_MOE, "parallelism=fsdp2_tp2_ep2", "training.steps=2"], run_dir=tmp_path / "a", timeout=300)
    assert first.ok, f"{first.error}\n{first.stderr[-3000:]}"
    folder = tmp_path / "a" / "checkpoints"
    assert sorted(p.name for p in folder.iterdir()) == ["step-1", "step-2"]
    assert [r["validation_step"] for r in _records(first.run_dir) if "validation_step" in r] == [1, 2]

    resumed = run([*TINY_MOE, "parallelism=fsdp2_pp2", "training.steps=3", f"checkpoint.folder={folder}"],
                  run_dir=tmp_path / "b", timeout=300)
    assert resumed.ok, f"{resumed.error}\n{resumed.stderr[-3000:]}"
    assert f"resumed from checkpoint {folder / 'step-2'} (step 2)" in resumed.stdout
    assert resumed.steps == [3]
    assert [r["validation_step"] for r in _records(resumed.run_dir) if "validation_step" in r] == [3]
    assert (folder / "step-3" / "manifest.json").is_file()
