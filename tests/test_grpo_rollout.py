"""objective=grpo's rollout stage, in one process: the batched KV-cache sampler (left
padding changes nothing a row samples; each completion's draws are its own), the
policy's log-probs through the fused head, data=prompts (TRL's prompt-only rows, the
layout-independent order), rollout=file (lines by position or prompt, one-line errors),
and the stage itself on a tiny model (EOS kept, truncation, masking, num_iterations'
reuse with old log-probs, completions.jsonl, a raising reward stopping in one line)."""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import pytest
import torch

from titan_plugins.components.kv_cache import KVCache
from titan_plugins.components.sampling import SamplingConfig
from titan_plugins.data.chat_source import ASSETS, CHAT_TOKENIZER
from titan_plugins.data.prompt_source import PromptDataset
from titan_plugins.data.tokenizer import Tokenizer
from titan_plugins.errors import ConfigError
from titan_plugins.loss.token_loss import IGNORE_INDEX
from titan_plugins.objectives.grpo import GRPOObjective
from titan_plugins.objectives.rollout_native import sample_completions
from titan_plugins.rewards.scoring import RewardError
from titan_plugins.testing.grpo import OneRankView, grpo_job, write_rollout_file

pytest.importorskip("titan_qwen3")
EOS = 2047  # the shipped ChatML tokenizer's <|im_end|>
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def model():
    from titan_qwen3.config import FLAVORS
    from titan_qwen3.model import build

    torch.manual_seed(0)
    m = build(dataclasses.replace(FLAVORS["debugmodel"], n_layers=2))
    m.init_weights()
    return m


def test_left_padding_changes_nothing_a_row_samples(model):
    short, long = [5, 6, 7], [9, 10, 11, 12, 13, 14, 15]
    with torch.no_grad():
        alone = model(torch.tensor([short]))[0, -1]
        cache = KVCache(torch.tensor([[True] * 4 + [False] * 3, [False] * 7]))
        padded = model(torch.tensor([[0] * 4 + short, long]), cache=cache)[0, -1]
    torch.testing.assert_close(padded, alone, rtol=0, atol=1e-5)  # positions shift; rotary attention does not see it
    cfg = SamplingConfig(max_new_tokens=12, temperature=1.0)
    one = sample_completions(model, [short], [42], cfg, [EOS], 0, CPU)
    batched = sample_completions(model, [long, short, short], [1, 42, 43], cfg, [EOS], 0, CPU)
    assert batched[1] == one[0] and batched[2] != one[0]  # each completion's own generator


def test_a_completion_ends_with_its_first_stop_id_kept():
    class Scripted(torch.nn.Module):  # row 0 says 3, then 2 (a stop); row 1 never stops
        def forward(self, tokens, cache=None):
            step = cache.pos
            logits = torch.full((2, tokens.shape[1], 8), -1e9)
            logits[0, -1, 2 if step > 3 else 3] = 0.0
            logits[1, -1, 4] = 0.0
            return logits

    out = sample_completions(Scripted(), [[1, 1, 1], [1]], [0, 1], SamplingConfig(max_new_tokens=5, temperature=1.0),
                             [2], 0, CPU)
    assert out == [[3, 3, 2], [4, 4, 4, 4, 4]]


def test_policy_log_probs_through_the_fused_head_equal_whole_logits():
    from titan_plugins.loss.fused import defer_head, restore_head
    from titan_plugins.loss.token_logps import token_logps

    torch.manual_seed(0)
    part = torch.nn.Sequential()
    part.output = torch.nn.Linear(16, 50)
    part.forward = lambda h: part.output(h)
    h = torch.randn(3, 7, 16, requires_grad=True)
    labels = torch.randint(0, 50, (3, 7))
    labels[:, :2] = IGNORE_INDEX
    want, want_ent = token_logps(part(h), labels, 0.7)
    (want.sum() + want_ent.sum()).backward()
    want_grad, h.grad = h.grad.clone(), None
    assert defer_head(part, "output", chunk_size=4, vocab_parallel=False)
    got, got_ent = token_logps(part(h), labels, 0.7)
    (got.sum() + got_ent.sum()).backward()
    restore_head(part, "output")
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(got_ent, want_ent)
    torch.testing.assert_close(h.grad, want_grad)
    assert (want[:, :2] == 0).all() and (want[:, 2:] < 0).all()


def _prompts_file(tmp_path, rows):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def test_prompt_rows_render_as_trl_and_keep_their_columns(tmp_path):
    from titan_plugins.chat.template import load_chat_template

    rows = [{"prompt": [{"role": "user", "content": "2+2="}], "answer": "4"}, {"prompt": "Count:", "answer": "x"}]
    tok = Tokenizer.load(CHAT_TOKENIZER)
    data = PromptDataset(grpo_job(_prompts_file(tmp_path, rows), None).data, tok, dp_rank=0, dp_world=1,
                         seq_len=64, seed=0)
    got = {json.dumps(r.prompt): r for r in (data.prompt_row(p) for p in range(2))}
    conv, plain = got[json.dumps(rows[0]["prompt"])], got[json.dumps("Count:")]
    template = load_chat_template(None, CHAT_TOKENIZER)
    assert conv.ids == tok.encode(template.render(rows[0]["prompt"], add_generation_prompt=True))
    assert tok.decode(conv.ids).endswith("<|im_start|>assistant\n") and conv.conversational
    assert plain.ids == tok.encode_text("Count:") and not plain.conversational
    assert conv.columns == {"answer": "4"} and plain.columns == {"answer": "x"}


def test_the_global_batch_of_prompts_does_not_depend_on_the_layout():
    tok = Tokenizer.load(CHAT_TOKENIZER)
    job = grpo_job(ASSETS / "arithmetic.jsonl", None)

    def positions(dp_world, accum, steps=2):
        out = []
        for rank in range(dp_world):
            data = PromptDataset(job.data, tok, dp_rank=rank, dp_world=dp_world, seq_len=64, seed=3)
            data.set_layout(2, accum)
            out += [p for k in range(steps * accum) for p in data._positions(k)]
        return sorted(out)

    assert positions(1, 4) == positions(2, 2) == positions(4, 1) == list(range(16))


def test_bad_prompt_rows_are_one_line(tmp_path):
    from titan_plugins.data.prompt_source import check_prompts

    for rows, message in (([{"prompt": []}], "field 'prompt' must be a string or a non-empty list of messages"),
                          ([{"question": "x"}], "field 'prompt' must be a string")):
        with pytest.raises(ConfigError) as info:
            check_prompts(grpo_job(_prompts_file(tmp_path, rows), None).data)
        assert message in str(info.value) and "prompts.jsonl:1" in str(info.value)


def _objective(**knobs):
    config = dict(num_generations=2, max_completion_length=6, temperature=1.0, reward_funcs=["accuracy"])
    config.update(knobs)
    return GRPOObjective(SimpleNamespace(**config))


def _stage_run(tmp_path, model, objective, *, rows=None, rollout="native", rollout_path=None):
    path = _prompts_file(tmp_path, rows or [{"prompt": [{"role": "user", "content": "1+1="}], "answer": "2"},
                                            {"prompt": [{"role": "user", "content": "3+4="}], "answer": "7"}])
    job = grpo_job(path, None, rollout=rollout, rollout_path=rollout_path)
    data = PromptDataset(job.data, Tokenizer.load(CHAT_TOKENIZER), dp_rank=0, dp_world=1, seq_len=64, seed=0)
    batch = SimpleNamespace(rows=[data.prompt_row(0), data.prompt_row(1)])
    return OneRankView(job, model, objective, tmp_path), batch


def test_rollout_file_replays_by_position_or_prompt_and_names_what_is_missing(tmp_path, model):
    objective = _objective(reward_funcs=["accuracy", "format"], reward_weights=[1.0, 0.5])
    run, batch = _stage_run(tmp_path, model, objective, rollout="file", rollout_path=tmp_path / "r.jsonl")
    first, second = batch.rows
    write_rollout_file(tmp_path / "r.jsonl", [
        {"step": 1, "position": first.position, "completion_ids": [[24, EOS], [25]], "rewards": {"accuracy": [1, 0]}},
        {"prompt": second.prompt, "completion_ids": [[26, 27, EOS], [EOS]], "rewards": {"accuracy": [None, 1]}},
    ])
    (out,) = objective.rollout(run, 1, [batch])
    assert [[t for t in row if t != IGNORE_INDEX] for row in out[1].tolist()] == [[24, EOS], [25], [26, 27, EOS], [EOS]]
    records = [json.loads(line) for line in (tmp_path / "completions.jsonl").read_text().splitlines()]
    assert [r["rewards"]["accuracy"] for r in records] == [1.0, 0.0, None, 1.0]
    assert [r["truncated"] for r in records] == [False, True, False, False]
    assert objective.rollout_metrics["rewards/accuracy/mean"] == pytest.approx(2 / 3)
    with pytest.raises(ConfigError, match=r"no line for step 2's prompt at position \d+ \(.*prompts.jsonl:\d\)$"):
        objective.rollout(run, 2, [batch])  # the step-1 line is used up; the step-less line still serves
    write_rollout_file(tmp_path / "r.jsonl", [{"position": p.position, "completion_ids": [[1]]} for p in batch.rows])
    objective.stage = None
    with pytest.raises(ConfigError, match="'completion_ids' must be 2 non-empty lists of token ids"):
        objective.rollout(run, 1, [batch])


def test_the_stage_keeps_the_eos_masks_truncated_completions_and_reuses_a_generation(tmp_path, model):
    objective = _objective(num_iterations=2, mask_truncated_completions=True)
    run, batch = _stage_run(tmp_path, model, objective)
    (out,) = objective.rollout(run, 1, [batch])
    inputs, labels = out
    assert inputs.shape[0] == 4 and out.old_logps is not None  # num_iterations=2: the sampler's log-probs
    records = [json.loads(line) for line in (tmp_path / "completions.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1] * 4 and all(r["length"] <= 6 for r in records)
    for row, record in zip(labels, records):
        counted = (row != IGNORE_INDEX).sum().item()
        assert counted == (0 if record["truncated"] else record["length"])  # masked: trains nothing
    assert objective.rollout_metrics["time/generation_s"] > 0
    assert objective.rollout(run, 2, [batch])[0] is out  # the same rows, the same old log-probs
    assert objective.rollout_metrics["time/generation_s"] == 0.0  # nothing sampled this step
    assert objective.rollout(run, 3, [batch])[0] is not out  # a new generation batch
    assert len((tmp_path / "completions.jsonl").read_text().splitlines()) == 8


def test_a_raising_reward_stops_the_step_naming_it_and_the_row(tmp_path, model):
    objective = _objective()
    run, batch = _stage_run(tmp_path, model, objective, rows=[{"prompt": "1+1="}, {"prompt": "2+2="}])
    with pytest.raises(RewardError) as info:
        objective.rollout(run, 1, [batch])
    assert str(info.value).startswith("reward 'accuracy' raised on ") and "prompts.jsonl:" in str(info.value)
    assert str(info.value).endswith("ValueError: needs an 'answer' column in the prompts data (the expected answer "
                                    "of each prompt)")
