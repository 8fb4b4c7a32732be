"""objective=dpo equals TRL 1.16 on the same pairs, fp32, step 1: the loss and every
metric TRL logs, for each loss type, on tiny random Qwen3 and Llama 3 folders, with a
second model as the reference (full fine-tuning) and with LoRA (the reference is the
base, adapters off). The pairs are tokenized by TRL's DPOTrainer and by our
data.name=preference source: the same ids and completion masks.

sigmoid/ipo/hinge/robust run TRL's own ``DPOTrainer._compute_loss`` on its collated
batch. SimPO and ORPO live in TRL's CPOTrainer/ORPOTrainer (trl.experimental, another
batch format): their loss functions (``cpo_loss``, ``odds_ratio_loss``) are called on
our sequence log-probs, and ORPO's SFT term is checked as the chosen tokens' mean NLL."""

from __future__ import annotations

import json
import math
import shutil
from types import SimpleNamespace

import pytest
import torch

transformers = pytest.importorskip("transformers")
trl = pytest.importorskip("trl")
peft = pytest.importorskip("peft")
datasets = pytest.importorskip("datasets")

from titan_plugins.config.hydra_glue import model_config  # noqa: E402
from titan_plugins.data.chat_source import ASSETS, CHAT_TOKENIZER  # noqa: E402
from titan_plugins.loss.token_loss import IGNORE_INDEX  # noqa: E402
from titan_plugins.objectives.dpo import DPOObjective, sequence_logps  # noqa: E402
from titan_plugins.objectives.reference import adapters_off  # noqa: E402
from titan_plugins.peft.lora import adapter_modules  # noqa: E402
from titan_plugins.plugins import get_plugin_manager  # noqa: E402
from titan_plugins.testing.model_parts import one_process_model  # noqa: E402
from titan_plugins.train.api import prepare_job  # noqa: E402

SHAPE = dict(vocab_size=2048, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=256, tie_word_embeddings=False,
             eos_token_id=2047, pad_token_id=2047)
MODELS = {"qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(rope_theta=10000.0)),
          "llama3": ("LlamaConfig", "LlamaForCausalLM", dict(rope_parameters={"rope_type": "default",
                                                                              "rope_theta": 10000.0}))}
OURS = ["wq", "wv", "w2"]
THEIRS = ["q_proj", "v_proj", "down_proj"]
PAIRS = [json.loads(line) for line in (ASSETS / "preference_sample.jsonl").read_text().splitlines()[:4]]
TOL = dict(rtol=1e-5, atol=1e-5)


def _folder(root, model: str, seed: int):
    cfg_cls, model_cls, extra = MODELS[model]
    torch.manual_seed(seed)
    hf = getattr(transformers, model_cls)(getattr(transformers, cfg_cls)(**SHAPE, **extra))
    with torch.no_grad():  # random (not HF's near-zero init) so every weight matters
        for p in hf.parameters():
            p.normal_(0.0, 0.2)
    folder = root / f"{model}-{seed}"
    hf.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):  # the shipped ChatML tokenizer
        shutil.copyfile(CHAT_TOKENIZER / name, folder / name)
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("dpo_trl")
    return {m: (_folder(root, m, 0), _folder(root, m, 1)) for m in MODELS}


def _hf(folder):
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="sdpa").float()
    return model.train()  # TRL logs train-mode metrics under "train" (no dropout in these configs)


def _ours(model: str, folder, *, lora: bool):
    pm = get_plugin_manager()
    extra = ["peft=lora", f"peft.target_modules=[{','.join(OURS)}]", "peft.dropout=0.0"] if lora else []
    spec, job, _ = prepare_job([f"model={model}", f"model.hf={folder}", "model.attn_backend=sdpa",
                                "data.name=synthetic", "data.vocab_size=2048", "training.seq_len=128", *extra], pm)
    return one_process_model(spec, job, folder).train()


def _trained_adapters(ours, theirs, model: str, folder):
    """The same non-zero adapters on both (as after some steps): B random, A as
    initialised; mapped to PEFT's modules as titan-export maps them (rows/columns of a
    rotary permutation included: titan_plugins/peft/mapping.py)."""
    from titan_plugins.peft.mapping import hf_targets, state_dict_adapter

    spec, job, _ = prepare_job([f"model={model}", f"model.hf={folder}", "data.name=synthetic",
                                "data.vocab_size=2048", "training.seq_len=128"], get_plugin_manager())
    adapter = state_dict_adapter(spec, model_config(job.model, spec), str(folder))
    gen = torch.Generator().manual_seed(3)
    named = dict(theirs.named_parameters())
    with torch.no_grad():
        for name, module in adapter_modules(ours):
            module.lora_B.weight.copy_(torch.randn(module.lora_B.weight.shape, generator=gen) * 0.3)
            a, b = module.lora_A.weight, module.lora_B.weight
            (target,) = hf_targets(adapter, name, (b.shape[0], a.shape[1]))
            prefix = f"base_model.model.{target.module}"
            named[f"{prefix}.lora_A.default.weight"].copy_(a[:, target.cols])
            named[f"{prefix}.lora_B.default.weight"].copy_(b[target.rows])


def _trl(policy, ref, tmp_path, peft_config=None, **config):
    args = trl.DPOConfig(output_dir=str(tmp_path / "trl"), report_to=[], per_device_train_batch_size=len(PAIRS),
                         use_cpu=True, bf16=False, max_length=None, **config)  # fp32 (TRL defaults to bf16)
    tok = transformers.AutoTokenizer.from_pretrained(CHAT_TOKENIZER)
    trainer = trl.DPOTrainer(model=policy, ref_model=ref, args=args, train_dataset=datasets.Dataset.from_list(PAIRS),
                             processing_class=tok, peft_config=peft_config)
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(len(PAIRS))])
    return trainer, batch


def _rows(batch):
    """TRL's collated batch as our rows: inputs ids[:-1], labels ids[1:] on the completion."""
    ids, completion = batch["input_ids"], batch["completion_mask"]
    return ids[:, :-1], ids[:, 1:].masked_fill(completion[:, 1:] == 0, IGNORE_INDEX)


def _our_step(objective, policy, reference_out, inputs, labels):
    count = tuple(float(x) for x in objective.count(labels))
    reference = objective.reference_stats(reference_out, labels) if objective.needs_reference else None
    loss, sums = objective.loss(policy(inputs), labels, scale=count, reference=reference)
    return loss, objective.metrics({k: float(v) for k, v in sums.items()}, count)


def test_our_preference_source_tokenizes_pairs_as_trl(folders, tmp_path):
    """data.name=preference renders and splits each pair as DPOTrainer does."""
    from titan_plugins.chat.template import load_chat_template
    from titan_plugins.data.preference_source import (
        PreferenceSettings,
        encode_pair,
        split_pair,
    )
    from titan_plugins.data.tokenizer import Tokenizer

    trainer, batch = _trl(_hf(folders["qwen3"][0]), None, tmp_path, beta=0.1)
    tok, template = Tokenizer.load(CHAT_TOKENIZER), load_chat_template(None, CHAT_TOKENIZER)
    n = len(PAIRS)
    for i, row in enumerate(PAIRS):
        prompt, chosen, rejected = split_pair(row, PreferenceSettings(), f"row {i}")
        rows, _ = encode_pair(prompt, chosen, rejected, template, tok, settings=PreferenceSettings(), seq_len=512,
                              where=f"row {i}")
        for side, (inputs, labels) in enumerate(rows):
            k = i + side * n
            length = int(batch["attention_mask"][k].sum())
            want_inputs, want_labels = (t[k, : length - 1].tolist() for t in _rows(batch))
            assert inputs == want_inputs and labels == want_labels, (i, side)


# Every loss type on Qwen3; Llama 3 runs sigmoid in the suite, its other loss types in
# make test-all (the same objective code on another model's log-probs; ~1 s each).
LOSSES = [("sigmoid", {}), ("ipo", {}), ("hinge", {}), ("robust", {"label_smoothing": 0.2})]
CASES = [pytest.param(model, loss_type, extra, id=f"{model}-{loss_type}",
                      marks=[pytest.mark.extended] if model != "qwen3" and loss_type != "sigmoid" else [])
         for model in MODELS for loss_type, extra in LOSSES]


@pytest.mark.parametrize("model, loss_type, extra", CASES)
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_step1_loss_and_metrics_equal_dpo_trainer(folders, tmp_path, model, lora, loss_type, extra):
    policy_dir, ref_dir = folders[model]
    ours = _ours(model, policy_dir, lora=lora)
    if lora:  # a new adapter: TRL's reference is the base (adapter disabled), ours adapters off
        lora_config = peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0,
                                      target_modules=THEIRS)
        trainer, batch = _trl(_hf(policy_dir), None, tmp_path, beta=0.1, loss_type=[loss_type],
                              peft_config=lora_config, **extra)
        _trained_adapters(ours, trainer.model, model, policy_dir)  # the policy is not the reference
    else:
        ours_ref = _ours(model, ref_dir, lora=False)
        trainer, batch = _trl(_hf(policy_dir), _hf(ref_dir), tmp_path, beta=0.1, loss_type=[loss_type], **extra)
    want_loss = trainer._compute_loss(trainer.model, batch, return_outputs=False)
    want = {k: v[-1] for k, v in trainer._metrics["train"].items() if k.startswith(("rewards/", "logps/"))}

    inputs, labels = _rows(batch)
    objective = DPOObjective(SimpleNamespace(loss_type=loss_type, beta=0.1, simpo_gamma=0.5,
                                             label_smoothing=extra.get("label_smoothing", 0.0)))
    with torch.no_grad():
        if lora:
            with adapters_off([ours]):
                ref_out = ours(inputs)
        else:
            ref_out = ours_ref(inputs)
    loss, got = _our_step(objective, ours, ref_out, inputs, labels)
    assert set(got) == set(want)
    torch.testing.assert_close(loss.detach(), want_loss.detach(), **TOL)
    for key in want:
        assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-5), key


@pytest.mark.parametrize("loss_type", ["simpo", "orpo"])
def test_reference_free_losses_equal_trl_loss_functions(folders, loss_type):
    """SimPO (CPOTrainer.cpo_loss, loss_type=simpo) and ORPO (ORPOTrainer.odds_ratio_loss
    plus the chosen tokens' mean NLL) on our average completion log-probs."""
    from trl.experimental.cpo import CPOTrainer
    from trl.experimental.orpo import ORPOTrainer

    ours = _ours("qwen3", folders["qwen3"][0], lora=False)
    _, batch = _trl(_hf(folders["qwen3"][0]), None, folders["qwen3"][0].parent, beta=0.1)
    inputs, labels = _rows(batch)
    cfg = SimpleNamespace(loss_type=loss_type, beta=0.2, simpo_gamma=0.7, label_smoothing=0.1 if loss_type == "simpo" else 0.0)
    objective = DPOObjective(cfg)
    assert not objective.needs_reference
    output = ours(inputs)
    loss, got = _our_step(objective, lambda _x: output, None, inputs, labels)
    logps, lengths = sequence_logps(output, labels)
    n = len(PAIRS)
    avg = logps / lengths
    fake = SimpleNamespace(beta=cfg.beta, label_smoothing=cfg.label_smoothing, simpo_gamma=cfg.simpo_gamma,
                           loss_type="simpo", alpha=0.0, accelerator=SimpleNamespace(device="cpu"))
    if loss_type == "simpo":
        losses, r_c, r_r = CPOTrainer.cpo_loss(fake, avg[:n], avg[n:])
        want_loss = losses.mean()
    else:
        losses, r_c, r_r, _, _ = ORPOTrainer.odds_ratio_loss(fake, avg[:n], avg[n:])
        nll = torch.nn.functional.cross_entropy(output[:n].flatten(0, 1), labels[:n].flatten(), ignore_index=-100)
        want_loss = nll - losses.mean()
        assert got["nll_loss"] == pytest.approx(nll.item(), rel=1e-5)
    torch.testing.assert_close(loss.detach(), want_loss.detach(), **TOL)
    want = {"rewards/chosen": r_c.mean(), "rewards/rejected": r_r.mean(), "rewards/margins": (r_c - r_r).mean(),
            "rewards/accuracies": (r_c > r_r).float().mean(), "logps/chosen": logps[:n].mean(),
            "logps/rejected": logps[n:].mean()}
    for key, value in want.items():
        assert got[key] == pytest.approx(value.item(), rel=1e-5, abs=1e-5), key


def test_at_init_the_sigmoid_loss_is_ln2_and_every_reward_zero(folders):
    """Policy = reference (LoRA at init: B = 0, so adapters off is the same function):
    the loss is exactly ln 2 in fp32 and every reward exactly 0."""
    ours = _ours("qwen3", folders["qwen3"][0], lora=True)
    _, batch = _trl(_hf(folders["qwen3"][0]), None, folders["qwen3"][0].parent, beta=0.1)
    inputs, labels = _rows(batch)
    with torch.no_grad(), adapters_off([ours]):
        ref_out = ours(inputs)
    objective = DPOObjective(SimpleNamespace(loss_type="sigmoid", beta=0.1, label_smoothing=0.0, simpo_gamma=0.5))
    loss, got = _our_step(objective, ours, ref_out, inputs, labels)
    assert loss.item() == torch.tensor(math.log(2), dtype=torch.float32).item()
    assert got["rewards/chosen"] == got["rewards/rejected"] == got["rewards/margins"] == 0.0
    assert got["rewards/accuracies"] == 0.0  # no pair is preferred yet (TRL counts chosen > rejected)
