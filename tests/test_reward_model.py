"""``reward_model`` (titan_plugins/rewards/reward_model.py): a Hugging Face
sequence-classification folder as a GRPO reward. Its scores equal TRL 1.16's: a real
GRPOTrainer built with the folders as reward models runs its own ``_calculate_rewards``
on the same prompts and completions (conversational and plain, one batch and several,
a tokenizer without a pad token); combined with another reward under weights it adds
in as TRL's weighted sum; a bad folder or option is one line before launch; a failure
while scoring names the reward and the row; ``titan-run --list`` shows it."""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import pytest
import torch

transformers = pytest.importorskip("transformers")
trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

from titan_plugins.data.prompt_source import PromptDataset  # noqa: E402
from titan_plugins.data.tokenizer import ASSETS, Tokenizer  # noqa: E402
from titan_plugins.errors import ConfigError  # noqa: E402
from titan_plugins.objectives.grpo import GRPOObjective  # noqa: E402
from titan_plugins.rewards import discover, load_rewards  # noqa: E402
from titan_plugins.rewards.scoring import RewardError, score  # noqa: E402
from titan_plugins.testing.grpo import OneRankView, grpo_job, write_rollout_file  # noqa: E402
from titan_plugins.testing.lora_refs import tiny_qwen3_folder  # noqa: E402

EOS = 2047  # the shipped ChatML tokenizer's <|im_end|>
SHAPE = dict(vocab_size=2048, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256)
CHAT = [[{"role": "user", "content": "12+7="}], [{"role": "user", "content": "12+7="}],
        [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "3-1=?"}],
        [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "3-1=?"}]]
REPLIES = ["19", "The answer is 19, I am quite sure of it.", "2", "two"]  # lengths differ: rows are right-padded
PLAIN = ["Say 5:", "Say 5:", "Count to three:", "Count to three:"]


def _tokenizer_into(folder, *, pad=True, chat_template=True):
    """The shipped ChatML tokenizer, loaded by transformers as the tokenizer.json says
    (not as the model type's own tokenizer class)."""
    shutil.copyfile(ASSETS / "chat_tokenizer" / "tokenizer.json", folder / "tokenizer.json")
    config = json.loads((ASSETS / "chat_tokenizer" / "tokenizer_config.json").read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    if not pad:
        config.pop("pad_token")
    if not chat_template:
        config.pop("chat_template")
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


def reward_model_folder(folder, *, seed=0, num_labels=1, head=True, **tokenizer):
    """A random ``LlamaForSequenceClassification`` (every weight normal, std 0.2, so every
    token matters) and its tokenizer; ``head=False`` saves the model without its score head."""
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(**SHAPE, num_labels=num_labels)
    model = transformers.LlamaForSequenceClassification(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    (model if head else model.model).save_pretrained(folder)
    if not head:  # the base model's weights under a classifier's config
        config.architectures = ["LlamaForSequenceClassification"]
        config.save_pretrained(folder)
    _tokenizer_into(folder, **tokenizer)
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("reward_model")
    return SimpleNamespace(root=root, rm=reward_model_folder(root / "rm", seed=0),
                           no_pad=reward_model_folder(root / "rm_no_pad", seed=1, pad=False))


@pytest.fixture(scope="module")
def world(folders):
    """The folders and a TRL GRPOTrainer that takes both as reward models."""
    policy = tiny_qwen3_folder(folders.root / "policy", eos_token_id=EOS, pad_token_id=EOS, max_position_embeddings=128)
    _tokenizer_into(policy)
    args = trl.GRPOConfig(output_dir=str(folders.root / "trl"), report_to=[], use_cpu=True, bf16=False,
                          per_device_train_batch_size=4, num_generations=4, max_completion_length=8)
    # TRL loads each folder itself (AutoModelForSequenceClassification, num_labels=1, and its tokenizer)
    trainer = trl.GRPOTrainer(model=str(policy), reward_funcs=[str(folders.rm), str(folders.no_pad)], args=args,
                              processing_class=transformers.AutoTokenizer.from_pretrained(policy),
                              train_dataset=datasets.Dataset.from_list([{"prompt": CHAT[0]}]))
    return SimpleNamespace(**vars(folders), trainer=trainer)


def _trl_scores(world, prompts, completions):
    """TRL's ``_calculate_rewards``: one column per reward folder."""
    inputs = [{"prompt": p} for p in prompts]
    return world.trainer._calculate_rewards(inputs, prompts, completions, [[1]] * len(prompts))


def _ours(path, prompts, completions, **options):
    (name, fn), = load_rewards(["reward_model"], {"reward_model": {"path": str(path), "device": "cpu", **options}},
                               registry=discover([]))
    return torch.tensor(fn(prompts=prompts, completions=completions, completion_ids=[[1]] * len(prompts)))


@pytest.mark.parametrize("kind", ["conversational", "plain"])
def test_scores_equal_trls_reward_model_scoring(world, kind):
    if kind == "conversational":  # the reward tokenizer's chat template over prompt + completion messages
        prompts, completions = CHAT, [[{"role": "assistant", "content": r}] for r in REPLIES]
    else:  # prompt + completion as text
        prompts, completions = PLAIN, [" " + r for r in REPLIES]
    theirs = _trl_scores(world, prompts, completions)
    assert theirs[:, 0].std() > 0.01  # the scores tell the pairs apart
    for column, folder in enumerate((world.rm, world.no_pad)):  # no pad token: both pad with the EOS
        for batch_size in (32, 3, 1):  # one forward, and batches padded to their own longest row
            ours = _ours(folder, prompts, completions, batch_size=batch_size)
            assert (ours - theirs[:, column]).abs().max() <= 1e-6, (folder.name, batch_size, ours, theirs[:, column])
    assert torch.equal(_ours(world.rm, prompts, completions), theirs[:, 0])  # one batch: TRL's very computation


def test_weighted_with_another_reward_it_adds_in_as_trls_weighted_sum(world, tmp_path):
    """objective=grpo's rollout stage (rollout=file): reward_funcs=[accuracy,reward_model],
    weights [1.0, 0.5]; the reward model scores the decoded completions as TRL does."""
    rows = [{"prompt": CHAT[0], "answer": "19"}, {"prompt": CHAT[2], "answer": "2"}]
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    tok = Tokenizer.load(world.rm)
    job = grpo_job(data, world.rm, rollout_path=tmp_path / "rollout.jsonl", seq_len=128)
    dataset = PromptDataset(job.data, tok, dp_rank=0, dp_world=1, seq_len=128, seed=0)
    prompt_rows = [dataset.prompt_row(p) for p in range(2)]
    replies = {0: REPLIES[:2], 1: REPLIES[2:]}  # each prompt's two completions, in the data's order
    by_prompt = {json.dumps(r["prompt"]): replies[k] for k, r in enumerate(rows)}
    write_rollout_file(tmp_path / "rollout.jsonl", [
        {"step": 1, "position": r.position,
         "completion_ids": [list(tok.encode_text(t)) + [EOS] for t in by_prompt[json.dumps(r.prompt)]]}
        for r in prompt_rows])
    config = SimpleNamespace(num_generations=2, max_completion_length=48, reward_funcs=["accuracy", "reward_model"],
                             reward_weights=[1.0, 0.5], reward_options={"reward_model": {"path": str(world.rm)}})
    objective = GRPOObjective(config)
    run = OneRankView(job, torch.nn.Identity(), objective, tmp_path)
    objective.rollout(run, 1, [SimpleNamespace(rows=prompt_rows)])
    records = [json.loads(line) for line in (tmp_path / "completions.jsonl").read_text().splitlines()]
    prompts = [r["prompt"] for r in records]
    completions = [r["completion"] for r in records]
    assert [c[0]["content"] for c in completions] == [t for r in prompt_rows for t in by_prompt[json.dumps(r.prompt)]]
    rm = _trl_scores(world, prompts, completions)[:, 0].tolist()
    correct = [1.0, 1.0, 1.0, 0.0]  # accuracy reads the last number: "... 19, I am quite sure" is right, "two" not
    assert [r["rewards"]["accuracy"] for r in records] == correct
    assert [r["rewards"]["reward_model"] for r in records] == pytest.approx(rm, abs=1e-6)
    assert [r["reward"] for r in records] == pytest.approx([a + 0.5 * s for a, s in zip(correct, rm)], abs=1e-6)
    metrics = objective.rollout_metrics
    assert metrics["rewards/reward_model/mean"] == pytest.approx(sum(rm) / 4, abs=1e-6)
    assert metrics["reward"] == pytest.approx(sum(correct) / 4 + 0.5 * sum(rm) / 4, abs=1e-6)
    assert objective.rewards[1][1].keywords["device"] == "cpu"  # the rank's device, bound by the stage


def _refusal(options):
    with pytest.raises(ConfigError) as info:
        load_rewards(["accuracy", "reward_model"], {"reward_model": options}, registry=discover([]))
    message = str(info.value)
    assert "\n" not in message and message.startswith("objective.reward_options.reward_model: "), message
    return message


def test_a_bad_folder_is_one_line(tmp_path):
    causal = tiny_qwen3_folder(tmp_path / "causal")
    two = reward_model_folder(tmp_path / "two_labels", num_labels=2)
    (tmp_path / "empty").mkdir()
    assert "no path: set +objective.reward_options.reward_model.path=FOLDER" in _refusal({})
    assert f"path={tmp_path / 'nowhere'} is not a folder with a config.json" in _refusal(
        {"path": str(tmp_path / "nowhere")})
    assert f"path={tmp_path / 'empty'} is not a folder with a config.json" in _refusal(
        {"path": str(tmp_path / "empty")})
    assert "architectures ['Qwen3ForCausalLM'] hold no sequence-classification model" in _refusal(
        {"path": str(causal)})
    assert "the model has num_labels=2; a reward model has one label" in _refusal({"path": str(two)})


@pytest.mark.parametrize("option, message", [
    ({"dtype": "float64"}, "dtype=float64: expected one of float32, bfloat16, float16"),
    ({"batch_size": 0}, "batch_size=0: expected a whole number of pairs per forward, at least 1"),
    ({"device": "gpu0"}, "device=gpu0: not a torch device"),
    ({"pth": "x"}, "'pth' is not an option of reward_model (options: path, dtype, device, batch_size, "),
    ({"chat_template_kwargs": "enable_thinking"}, "chat_template_kwargs='enable_thinking': expected a mapping"),
], ids=["dtype", "batch_size", "device", "unknown", "chat_template_kwargs"])
def test_a_bad_option_is_one_line(folders, option, message):
    assert message in _refusal({"path": str(folders.rm), **option})


def test_titan_run_refuses_a_reward_model_without_a_folder_before_launch(tmp_path):
    from titan_plugins.train.api import run

    pytest.importorskip("titan_qwen3")
    with pytest.raises(ConfigError) as info:
        run(["model=qwen3", "model.n_layers=1", "objective=grpo", "data=prompts", "training.seq_len=64",
             "objective.max_completion_length=12", "objective.reward_funcs=[accuracy,reward_model]",
             "objective.reward_weights=[1.0,0.5]"], run_dir=tmp_path / "refused", timeout=60)
    assert str(info.value) == ("objective.reward_options.reward_model: no path: set +objective.reward_options."
                               "reward_model.path=FOLDER (a Hugging Face sequence-classification model)")
    assert not (tmp_path / "refused" / "metrics.jsonl").exists()


def _score_once(path, prompts, completions):
    (_, fn), = load_rewards(["reward_model"], {"reward_model": {"path": str(path)}}, registry=discover([]))
    return score([("reward_model", fn)], prompts=prompts, completions=completions,
                 completion_ids=[[1]] * len(prompts), columns={}, wheres=[f"prompts.jsonl:{i + 1}" for i in range(4)])


def test_a_failure_while_scoring_names_the_reward_and_the_row(tmp_path):
    completions = [[{"role": "assistant", "content": r}] for r in REPLIES]
    no_template = reward_model_folder(tmp_path / "no_template", chat_template=False)
    with pytest.raises(RewardError) as info:  # conversational prompts, and the tokenizer has no chat template
        _score_once(no_template, CHAT, completions)
    message = str(info.value)
    assert message.startswith("reward 'reward_model' raised on prompts.jsonl:1 (completion '19'): ValueError: ")
    assert "chat_template" in message and "\n" not in message
    headless = reward_model_folder(tmp_path / "headless", head=False)
    with pytest.raises(RewardError) as info:  # a random score head would score noise
        _score_once(headless, CHAT, completions)
    assert str(info.value) == (f"reward 'reward_model' raised on prompts.jsonl:1 (completion '19'): ValueError: "
                               f"{headless} lacks weights the model needs: score.weight")


def test_titan_run_list_shows_it(capsys):
    from titan_plugins.cli.run import main as run_main

    assert run_main(["--list"]) == 0
    out = capsys.readouterr().out
    listed = out[out.index("rewards (objective.reward_funcs=[NAME,...]):"):].splitlines()
    line = next(line for line in listed if line.split()[:1] == ["reward_model"])
    assert "titan-plugins==" in line and "sequence-classification folder" in line
