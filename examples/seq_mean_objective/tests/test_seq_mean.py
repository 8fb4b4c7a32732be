"""The example objective: discovered from its entry point, its loss equals a hand
computation, and a short run trains with it and logs its metric."""

from __future__ import annotations

import json

import pytest
import torch
from omegaconf import OmegaConf

from titan_plugins.loss.token_loss import IGNORE_INDEX
from titan_plugins.objectives import build_objective, discover


def test_it_is_discovered_from_its_distribution():
    reg = discover()
    assert "seq_mean" in reg.specs, reg.errors
    assert reg.origins["seq_mean"].startswith("titan-seq-mean-objective==")


def test_its_loss_is_the_mean_of_the_rows_mean_nll():
    objective = build_objective(OmegaConf.create({"name": "seq_mean", "options": {"weight": 2.0}}))
    torch.manual_seed(0)
    logits = torch.randn(3, 5, 7)
    labels = torch.randint(0, 7, (3, 5))
    labels[0, 1:] = IGNORE_INDEX  # one label
    labels[2] = IGNORE_INDEX  # none: does not count
    count = float(objective.count(labels))
    loss, sums = objective.loss(logits, labels, scale=count)
    rows = [torch.nn.functional.cross_entropy(logits[i][labels[i] != IGNORE_INDEX], labels[i][labels[i] != IGNORE_INDEX])
            for i in (0, 1)]
    assert count == 2.0
    torch.testing.assert_close(loss, 2.0 * (rows[0] + rows[1]) / 2)
    assert float(sums["seq_mean/tokens_per_row"]) == 6.0


def test_a_short_run_trains_with_it(tmp_path):
    pytest.importorskip("titan_qwen3")
    from titan_plugins.train.api import run

    result = run(["model=qwen3", "model.n_layers=1", "model.dim=32", "model.n_heads=2", "model.n_kv_heads=1",
                  "model.head_dim=16", "model.hidden_dim=64", "training.seq_len=32", "training.steps=2",
                  "metrics.tensorboard=false", "metrics.console=false", "objective.name=seq_mean"],
                 run_dir=tmp_path / "run", timeout=300)
    assert result.returncode == 0, result.error
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(result.losses) == 2 and all(r["seq_mean/tokens_per_row"] > 0 for r in records if "step" in r)
