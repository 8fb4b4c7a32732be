"""titan-generate end to end: train a tiny model on a repeated phrase, sample it back."""

from __future__ import annotations

import pytest

from titan_plugins.cli.generate import main as generate_main
from titan_plugins.train.api import run

PHRASE = "the quick brown fox jumps over the lazy dog. "


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("gen")
    (root / "docs").mkdir()
    (root / "docs" / "phrase.txt").write_text(PHRASE * 200)
    result = run(
        ["model=qwen3", "model.n_layers=1", "data.name=text", f"data.path={root / 'docs'}",
         "training.steps=30", "training.seq_len=32", "training.local_batch_size=4", "training.warmup_steps=2",
         "checkpoint.enabled=true", "checkpoint.interval=1000",
         "metrics.tensorboard=false"],
        run_dir=root / "run", timeout=240,
    )
    assert result.returncode == 0, result.error
    return root / "run"


def test_greedy_generation_reproduces_the_trained_phrase(trained_run, capsys):
    prompt = "the quick brown fox"
    assert generate_main([str(trained_run), "--prompt", prompt, "--max-new-tokens", "24", "--ignore-eos"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(prompt)
    assert out.startswith(prompt + " jumps over the lazy dog. the quick brown fox"), out


def test_cache_and_no_cache_agree_and_sampling_runs(trained_run, capsys):
    args = [str(trained_run), "--prompt", "over the", "--max-new-tokens", "16", "--ignore-eos"]
    assert generate_main(args) == 0
    cached = capsys.readouterr().out
    assert generate_main([*args, "--no-cache"]) == 0
    assert capsys.readouterr().out == cached
    assert generate_main([*args, "--temperature", "0.8", "--top-k", "5", "--top-p", "0.9", "--seed", "1"]) == 0


def test_bad_input_is_one_line_exit_2(tmp_path, capsys):
    assert generate_main([str(tmp_path), "--prompt", "x"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "neither a run directory" in err[0]
    assert generate_main([str(tmp_path), "--prompt", "x", "--top-p", "0"]) == 2
    assert "top_p=0" in capsys.readouterr().err


def test_titan_eval_on_the_local_task_returns_a_score(trained_run, capsys):
    pytest.importorskip("lm_eval")
    import json
    from pathlib import Path

    from titan_plugins.cli.eval import main as eval_main

    tasks = Path(__file__).parent / "data" / "eval_task"
    assert eval_main([str(trained_run), "--tasks-dir", str(tasks), "--tasks", "titan_heldout"]) == 0
    scores = json.loads(capsys.readouterr().out)["results"]["titan_heldout"]
    assert scores["perplexity,none"] > 1.0 and 0.0 <= scores["acc,none"] <= 1.0
    assert eval_main([str(trained_run), "--tasks-dir", str(tasks), "--tasks", "nope"]) == 2
    assert "--tasks=nope: no such task" in capsys.readouterr().err
