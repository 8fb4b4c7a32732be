"""objective=grpo equals TRL 1.16's GRPOTrainer on the same prompts, the same completions
and the same rewards, fp32: the loss and every metric TRL logs, for each loss_type,
scale_rewards and importance_sampling_level, with and without beta (the KL to a
reference, with and without the ratio's bias correction), with num_iterations 1 (the ratio exactly 1) and 2 (the old log-probs kept
while the policy moved).

Both sides are fed the completions: ours through rollout=file and the real rollout stage
(decode, rewards, advantages, rows), TRL's through its ``rollout_func``; then TRL's own
``_generate_and_score_completions`` and ``_compute_loss`` run on its trainer, ours
``GRPOObjective.loss`` on our model loaded from the same Hugging Face folder. The knobs
that do not change what TRL builds at init are set on one trainer per beta; two more cases
turn TRL's ``use_bias_correction_kl`` (on by default) off."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

transformers = pytest.importorskip("transformers")
trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

from titan_plugins.data.prompt_source import PromptDataset  # noqa: E402
from titan_plugins.data.tokenizer import Tokenizer  # noqa: E402
from titan_plugins.objectives.grpo import GRPOObjective  # noqa: E402
from titan_plugins.plugins import get_plugin_manager  # noqa: E402
from titan_plugins.testing.grpo import OneRankView, grpo_job, write_rollout_file  # noqa: E402
from titan_plugins.testing.lora_refs import tiny_qwen3_folder  # noqa: E402
from titan_plugins.testing.model_parts import one_process_model  # noqa: E402
from titan_plugins.train.api import prepare_job  # noqa: E402

EOS = 2047  # the shipped ChatML tokenizer's <|im_end|>: its EOS and padding
G, L, T = 4, 6, 0.7  # num_generations, max_completion_length, temperature
ROWS = [{"prompt": [{"role": "user", "content": "12+7="}], "answer": "19"},
        {"prompt": [{"role": "user", "content": "3-1="}], "answer": "2"},
        {"prompt": "Say 5:", "answer": "5"}]
# Two prompts' groups: EOS-ended and truncated (full length, and short without EOS).
COMPLETIONS = [[[40, 41, EOS], [52, 53, 54, 55, 56, 57], [60, EOS], [70, 71, 72]],
               [[80, 81, 82, 83, EOS], [90, EOS], [100, 101, 102, 103, 104, 105], [110, 111, EOS]]]
TOL = dict(rtol=1e-5, atol=1e-5)


def _first(completion_ids, **kwargs):
    """Varies within the first group; the second group is all 1.0 (zero std)."""
    return [float(ids[0] % 3) if ids[0] < 80 else 1.0 for ids in completion_ids]


def _second(completion_ids, answer, **kwargs):
    """None (skipped) for EOS-ended completions; otherwise depends on the answer column."""
    return [None if ids[-1] == EOS else len(ids) / 10 + len(a) for ids, a in zip(completion_ids, answer)]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("grpo_trl")
    shape = dict(eos_token_id=EOS, pad_token_id=EOS, max_position_embeddings=128)
    ref = tiny_qwen3_folder(root / "ref", seed=0, **shape)
    policy = tiny_qwen3_folder(root / "policy", seed=1, **shape)
    for folder in (ref, policy):  # transformers would load a qwen3 folder's tokenizer as Qwen2Tokenizer, with
        # Qwen's own pre-tokenizer (digits one by one) instead of the shipped tokenizer.json's
        config = json.loads((folder / "tokenizer_config.json").read_text())
        config["tokenizer_class"] = "PreTrainedTokenizerFast"
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
    moved = root / "moved"  # the policy after an update: near it, so some ratios clip and some do not
    model = transformers.AutoModelForCausalLM.from_pretrained(policy)
    torch.manual_seed(5)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    model.save_pretrained(moved)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (moved / name).write_bytes((policy / name).read_bytes())
    data = root / "prompts.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS[:2]), encoding="utf-8")
    pm = get_plugin_manager()
    spec, job, _ = prepare_job(["model=qwen3", f"model.hf={policy}", "model.attn_backend=sdpa", "data.name=synthetic",
                                "data.vocab_size=2048", "training.seq_len=64"], pm)
    ours = {name: one_process_model(spec, job, folder).train() for name, folder in
            (("ref", ref), ("policy", policy), ("moved", moved))}
    theirs = {name: transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="sdpa").float()
              for name, folder in (("policy", policy), ("moved", moved))}
    return SimpleNamespace(root=root, ref=ref, policy=policy, data=data, ours=ours,
                           theirs={k: v.state_dict() for k, v in theirs.items()})


def _prompt_rows(world):
    tok = Tokenizer.load(world.policy)
    dataset = PromptDataset(grpo_job(world.data, world.policy).data, tok, dp_rank=0, dp_world=1, seq_len=64, seed=0)
    return [dataset.prompt_row(p) for p in range(2)]


@pytest.fixture(scope="module")
def trainers(world):
    """One TRL trainer per beta (beta > 0 loads the reference from the folder the model came from)."""
    rows = _prompt_rows(world)
    prompt_ids = {json.dumps(r.prompt): r.ids for r in rows}
    by_prompt = {json.dumps(r.prompt): COMPLETIONS[k] for k, r in enumerate(rows)}

    def rollout_func(prompts, trainer):
        seen = {}
        ids = []
        for p in prompts:  # a prompt's k-th appearance gets its k-th completion
            key = json.dumps(p)
            ids.append(by_prompt[key][seen.get(key, 0)])
            seen[key] = seen.get(key, 0) + 1
        return {"prompt_ids": [prompt_ids[json.dumps(p)] for p in prompts], "completion_ids": ids, "logprobs": None}

    out = {}
    tok = transformers.AutoTokenizer.from_pretrained(world.policy)
    for beta in (0.0, 0.04):
        args = trl.GRPOConfig(output_dir=str(world.root / f"trl-{beta}"), report_to=[], use_cpu=True, bf16=False,
                              per_device_train_batch_size=G * 2, num_generations=G, max_completion_length=L,
                              temperature=T, beta=beta, reward_weights=[1.0, 0.5])
        model = transformers.AutoModelForCausalLM.from_pretrained(world.ref, attn_implementation="sdpa").float()
        _first.__name__, _second.__name__ = "first", "second"
        trainer = trl.GRPOTrainer(model=model, reward_funcs=[_first, _second], args=args, processing_class=tok,
                                  train_dataset=datasets.Dataset.from_list(ROWS[:2]), rollout_func=rollout_func)
        trainer.current_gradient_accumulation_steps = 1  # set by the training loop, which we do not run
        out[beta] = trainer
    return SimpleNamespace(by_beta=out, rows=rows)


def test_our_prompts_render_as_trl_tokenizes_them(world, trainers):
    trainer = trainers.by_beta[0.0]
    rows = trainers.rows
    ids, _, _ = trainer._tokenize_prompts([r.prompt for r in rows])
    assert [list(i) for i in ids] == [r.ids for r in rows]


def _theirs(world, trainers, case):
    trainer = trainers.by_beta[case["beta"]]
    trainer.model.load_state_dict(world.theirs["policy"])
    for key in ("loss_type", "scale_rewards", "importance_sampling_level", "num_iterations",
                "mask_truncated_completions"):
        setattr(trainer, key, case[key])
    trainer.args.use_bias_correction_kl = case.get("use_bias_correction_kl", True)
    trainer.epsilon_low, trainer.epsilon_high = 0.2, 0.28
    trainer.model.train()
    trainer._metrics["train"].clear()
    inputs = [{"prompt": r.prompt, "answer": r.columns["answer"]} for r in trainers.rows for _ in range(G)]
    out = trainer._generate_and_score_completions(inputs)
    if case["num_iterations"] == 2:  # the policy moved since it sampled; the old log-probs stay
        trainer.model.load_state_dict(world.theirs["moved"])
    loss = trainer._compute_loss(trainer.model, out)
    metrics = {k: v[-1] for k, v in trainer._metrics["train"].items() if k != "num_tokens"}
    trainer.model.load_state_dict(world.theirs["policy"])
    return loss.detach(), metrics


def _ours(world, trainers, case, tmp_path):
    lines = [{"step": 1, "position": r.position, "completion_ids": COMPLETIONS[k]} for k, r in enumerate(trainers.rows)]
    path = write_rollout_file(tmp_path / "rollout.jsonl", lines)
    config = SimpleNamespace(num_generations=G, max_completion_length=L, temperature=T, epsilon=0.2, epsilon_high=0.28,
                             reward_funcs=["first", "second"], reward_weights=[1.0, 0.5], **case)
    objective = GRPOObjective(config)
    objective.rewards = [("first", _first), ("second", _second)]
    run = OneRankView(grpo_job(world.data, world.policy, rollout_path=path), world.ours["policy"], objective, tmp_path)
    batch = SimpleNamespace(rows=trainers.rows)
    (rollout,) = objective.rollout(run, 1, [batch])
    policy = world.ours["moved" if case["num_iterations"] == 2 else "policy"]
    inputs, labels = rollout
    reference = None
    if case["beta"]:
        with torch.no_grad():
            reference = objective.reference_stats(world.ours["ref"](inputs), labels)
    count = tuple(float(x) for x in objective.count(labels))
    loss, sums = objective.loss(policy(inputs), labels, scale=count, reference=reference,
                                **objective.loss_inputs(rollout))
    metrics = objective.metrics({k: float(v) for k, v in sums.items()}, count)
    return loss.detach(), metrics, rollout


CASES = [dict(loss_type=lt, scale_rewards=sr, importance_sampling_level=lvl, beta=beta, num_iterations=it,
              mask_truncated_completions=lt == "dapo" and it == 2)
         for lt in ("grpo", "dapo", "dr_grpo", "bnpo") for sr in ("group", "batch", "none")
         for lvl in ("token", "sequence") for beta in (0.0, 0.04) for it in (1, 2)]
CASES += [dict(loss_type=lt, scale_rewards="group", importance_sampling_level=lvl, beta=0.04, num_iterations=2,
               mask_truncated_completions=False, use_bias_correction_kl=False)
          for lt, lvl in (("dapo", "token"), ("grpo", "sequence"))]  # TRL's use_bias_correction_kl off


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(str(v) for v in c.values()))
def test_loss_and_metrics_equal_grpo_trainer(world, trainers, tmp_path, case):
    want_loss, want = _theirs(world, trainers, case)
    loss, got, _ = _ours(world, trainers, case, tmp_path)
    assert set(want) <= set(got), sorted(set(want) - set(got))
    torch.testing.assert_close(loss, want_loss, **TOL)
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=1e-5, abs=1e-5, nan_ok=True), key


def test_at_the_first_iteration_the_ratio_is_exactly_one(world, trainers, tmp_path):
    """num_iterations=1: the old log-probs are the policy's own, detached; nothing clips."""
    case = dict(loss_type="dapo", scale_rewards="group", importance_sampling_level="token", beta=0.0,
                num_iterations=1, mask_truncated_completions=False)
    _, metrics, rollout = _ours(world, trainers, case, tmp_path)
    assert rollout.old_logps is None
    assert all(metrics[k] == 0.0 for k in ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"))
    from titan_plugins.loss.token_logps import token_logps
    from titan_plugins.objectives.grpo_loss import per_token_loss

    logps, _ = token_logps(world.ours["policy"](rollout[0]), rollout[1], T)
    mask = (rollout[1] != -100).float()
    _, coef, _ = per_token_loss(logps, logps.detach(), rollout.advantages, mask, level="token", epsilon_low=0.2,
                                epsilon_high=0.2, beta=0.0)
    assert torch.equal(coef, torch.ones_like(coef))
