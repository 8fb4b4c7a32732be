"""The shipped verifiable tasks (objective=grpo's prompts and their SFT warm starts) are
what their generators build: deterministic, disjoint between RL and SFT, each answer right."""

from __future__ import annotations

import json

import pytest

from titan_plugins.data import arithmetic_task, reverse_task
from titan_plugins.data.chat_source import ASSETS


@pytest.mark.parametrize("task", [arithmetic_task, reverse_task], ids=["arithmetic", "reverse"])
def test_shipped_files_are_the_generators_output(task):
    built = task.build()
    for name, rows in built.items():
        shipped = [json.loads(line) for line in (ASSETS / name).read_text(encoding="utf-8").splitlines()]
        assert shipped == rows, name
    rl_name, sft_name = list(built)
    asked = {r["prompt"][0]["content"] for r in built[rl_name]}
    taught = {r["messages"][0]["content"] for r in built[sft_name]}
    assert not asked & taught
    answers = dict(task.questions())
    assert all(str(answers[r["prompt"][0]["content"]]) == r["answer"] for r in built[rl_name])
