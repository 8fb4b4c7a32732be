"""End to end through the runtime (titan_plugins.train.api.run, the engine of titan-run)
on 8 gloo ranks, with small shapes to keep the suite short."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

api = pytest.importorskip("titan_plugins.train.api")

COMMON = [
    "model=deepseek_v3", "model.n_layers=2", "training.seq_len=32", "training.local_batch_size=2",
    "training.warmup_steps=1", "metrics.tensorboard=false", "training.deterministic=true",
]


def _run(overrides, run_dir: Path):
    result = api.run(overrides, run_dir=run_dir, timeout=480)
    assert result.returncode == 0, f"{' '.join(overrides)}: {result.error}\n{result.stderr[-3000:]}"
    return result


@pytest.mark.slow
def test_fsdp4_tp2_ep2_matches_single_rank(workdir: Path):
    """8 ranks (dp_shard 4 x tp 2, ep 2 borrowing tp) against one rank that sees the
    same global batch as 4 accumulation microbatches, from one seed checkpoint."""
    from titan_plugins.compare.tolerances import LOSS_PARITY

    steps = ["training.steps=4"]
    folder = workdir / "seed_ckpt"
    _run([*COMMON, *steps, "parallelism=single", "checkpoint.create_seed=true", f"checkpoint.folder={folder}"],
         workdir / "seed")
    seed = f"checkpoint.init_from={folder / 'seed'}"
    base = _run([*COMMON, *steps, seed, "parallelism=single", "training.grad_accum_steps=4"], workdir / "single")
    test = _run([*COMMON, *steps, seed, "parallelism=fsdp4_tp2_ep2"], workdir / "fsdp4_tp2_ep2")
    print("single:", base.losses, "\nfsdp4_tp2_ep2:", test.losses)
    assert len(base.losses) == len(test.losses) == 4
    for step, (b, t) in enumerate(zip(base.losses, test.losses), start=1):
        assert LOSS_PARITY.allows(b, t), f"step {step}: {t} (8 ranks) vs {b} (1 rank)"
    assert test.losses[-1] < test.losses[0]


@pytest.mark.slow
def test_pp2_tp2_ep2_trains(workdir: Path):
    """fsdp2_tp2_ep2_pp2: 8 ranks, two pipeline stages (the second without
    tok_embeddings, the first without norm / lm_head) train 3 steps."""
    result = _run([*COMMON, "training.steps=3", "parallelism=fsdp2_tp2_ep2_pp2"], workdir / "pp")
    print("pp2:", result.losses)
    assert len(result.losses) == 3 and all(math.isfinite(x) for x in result.losses)
    assert result.losses[-1] < result.losses[0]
