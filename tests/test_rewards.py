"""Rewards as plugins (titan_plugins/rewards): the entry-point group ``titan_plugins.rewards``
discovered like objectives (one line per broken package, a clash named), TRL's signature,
the shipped accuracy / format / length rewards, weights and options, and the one-line
stop when a reward raises, returns the wrong count or a non-number; None skips."""

from __future__ import annotations

import math

import pytest

from titan_plugins.errors import ConfigError
from titan_plugins.rewards import discover, load_rewards
from titan_plugins.rewards.builtin import accuracy, format, length
from titan_plugins.rewards.scoring import RewardError, score


class _EP:
    def __init__(self, name, value, obj=None, exc=None):
        self.name, self.value, self._obj, self._exc = name, value, obj, exc

    def load(self):
        if self._exc:
            raise self._exc
        return self._obj


def exact(prompts, completions, completion_ids, **kwargs):
    """1 for a completion of one token."""
    return [float(len(ids) == 1) for ids in completion_ids]


def test_builtins_and_an_installed_reward_are_discovered():
    reg = discover([(_EP("exact", "pkg.mod:exact", exact), "my-dist==1.0")])
    assert {"accuracy", "format", "length", "reward_model", "exact"} <= set(reg.refs) and not reg.errors
    assert reg.origins["exact"] == "my-dist==1.0" and reg.descriptions["exact"] == "1 for a completion of one token."
    (name, fn), = load_rewards(["exact"], registry=reg)
    assert name == "exact" and fn(prompts=["p"], completions=["c"], completion_ids=[[1]]) == [1.0]


@pytest.mark.parametrize("ep, message", [
    (_EP("bad", "pkg.bad:f", exc=ImportError("no module named pkg")),
     "reward 'bad' (pkg.bad:f) from bad-dist==2 failed to load: ImportError: no module named pkg"),
    (_EP("accuracy", "pkg.acc:f", exact), "reward 'accuracy' is registered by both titan-plugins=="),
    (_EP("nope", "pkg.nope:X", 3), "reward entry point 'nope' from bad-dist==2 is a int, not a function"),
])
def test_a_broken_reward_package_is_one_line_naming_it(ep, message):
    reg = discover([(ep, "bad-dist==2")])
    assert any(message in e for e in reg.errors), reg.errors
    with pytest.raises(ConfigError) as info:
        load_rewards(["format"], registry=reg)  # a run is strict
    assert message in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("names, options, message", [
    (["acuracy"], {}, "objective.reward_funcs: 'acuracy' is not a known reward; did you mean 'accuracy'?"),
    (["format", "format"], {}, "a reward is named twice"),
    (["format"], {"length": {"soft_punish_cache": 2}}, "objective.reward_options.length: 'length' is not among"),
])
def test_bad_reward_choices_are_one_line(names, options, message):
    with pytest.raises(ConfigError) as info:
        load_rewards(names, options, registry=discover([]))
    assert message in str(info.value) and "\n" not in str(info.value)


def test_accuracy_compares_numbers_as_numbers_and_skips_rows_without_an_answer():
    completions = [[{"role": "assistant", "content": "the sum is 19"}], [{"role": "assistant", "content": "19.0"}],
                   [{"role": "assistant", "content": "<answer>7</answer> then 19"}], "no number", "12", "blue"]
    answers = ["19", "19", "19", "19", None, "blue"]
    got = accuracy(prompts=[""] * 6, completions=completions, completion_ids=[[1]] * 6, answer=answers)
    assert got == [1.0, 1.0, 0.0, 0.0, None, 1.0]  # <answer> tags win over the text after them
    with pytest.raises(ValueError, match="needs an 'answer' column"):
        accuracy(prompts=[""], completions=["1"], completion_ids=[[1]])


def test_format_matches_the_whole_completion_and_takes_a_pattern():
    good = "<think>\nadd them\n</think>\n<answer>19</answer>"
    assert format(prompts=[""] * 3, completions=[good, "19", good + " extra"], completion_ids=[[1]] * 3) == [1.0, 0, 0]
    assert format(prompts=[""], completions=[" 42 "], completion_ids=[[1]], pattern=r"-?\d+") == [1.0]


def test_length_is_daposs_soft_overlong_punishment():
    ids = [[0] * n for n in (4, 6, 7, 8, 9)]
    got = length(prompts=[""] * 5, completions=[""] * 5, completion_ids=ids, max_completion_len=8, soft_punish_cache=2)
    assert got == [0.0, 0.0, -0.5, -1.0, -1.0]
    (_, fn), = load_rewards(["length"], {"length": {"max_completion_len": 8}}, registry=discover([]))
    assert fn(prompts=[""], completions=[""], completion_ids=[[0] * 7]) == [-0.5]  # cache: a quarter of 8


def _score(rewards, **kw):
    args = dict(prompts=["p1", "p2"], completions=["a", "bb"], completion_ids=[[1], [2, 3]],
                columns={"answer": ["1", "2"]}, wheres=["data.jsonl:1", "data.jsonl:2"])
    args.update(kw)
    return score(rewards, **args)


def test_none_skips_a_function_for_a_row_and_columns_arrive_by_name():
    seen = {}

    def picky(prompts, completions, completion_ids, answer, **kwargs):
        seen.update(prompts=prompts, completions=completions, completion_ids=completion_ids, answer=answer)
        return [None, 0.5]

    table = _score([("picky", picky), ("exact", exact)])
    assert math.isnan(table[0][0]) and table[0][1] == 0.5 and table[1] == [1.0, 0.0]
    assert seen == dict(prompts=["p1", "p2"], completions=["a", "bb"], completion_ids=[[1], [2, 3]], answer=["1", "2"])
    assert _score([("exact", exact)], given={"exact": [0.25, None]})[0][:1] == [0.25]  # rollout=file's rewards


def test_a_reward_that_raises_names_itself_and_the_row_in_one_line():
    def fragile(prompts, completions, completion_ids, **kwargs):
        return [1.0 / (len(c) - 2) for c in completions]  # "bb": division by zero

    with pytest.raises(RewardError) as info:
        _score([("exact", exact), ("fragile", fragile)])
    assert str(info.value) == "reward 'fragile' raised on data.jsonl:2 (completion 'bb'): ZeroDivisionError: " \
                              "float division by zero"


@pytest.mark.parametrize("values, message", [
    ([1.0], "reward 'short' returned 1 rewards for 2 completions"),
    ([1.0, "high"], "reward 'short' returned 'high' for data.jsonl:2: a reward is a number or None"),
])
def test_a_reward_with_the_wrong_answer_shape_is_one_line(values, message):
    with pytest.raises(RewardError) as info:
        _score([("short", lambda **kw: values)])
    assert message in str(info.value) and "\n" not in str(info.value)


def test_titan_run_list_shows_the_rewards_and_a_broken_one(monkeypatch, capsys):
    """``titan-run --list`` (and ``--json``): the core's rewards, an installed one, a broken one as a load error."""
    import json

    from titan_plugins.cli.run import main as run_main
    from titan_plugins.rewards import registry

    installed = [(_EP("exact", "pkg.mod:exact", exact), "my-dist==1.0"),
                 (_EP("bad", "pkg.bad:f", exc=ImportError("no module named pkg")), "bad-dist==2")]
    monkeypatch.setattr(registry, "_entry_points", lambda: iter(installed))
    assert run_main(["--list"]) == 0
    out = capsys.readouterr().out
    listed = out[out.index("rewards (objective.reward_funcs=[NAME,...]):"):].splitlines()
    assert [line.split()[0] for line in listed[1:6]] == ["accuracy", "format", "length", "reward_model", "exact"]
    assert "reward 'bad' (pkg.bad:f) from bad-dist==2 failed to load: ImportError" in out
    assert run_main(["--list", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert ("exact", "my-dist==1.0") in [(r["name"], r["origin"]) for r in data["rewards"]]
    assert any("reward 'bad'" in e for e in data["errors"])
