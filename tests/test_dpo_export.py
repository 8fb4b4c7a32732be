"""A ``peft=lora objective=dpo`` run from a Hugging Face folder, end to end: at
initialisation it is the reference (loss exactly ln 2, every reward 0), on a toy set it
learns the preference, and the result is handed on like any run's: ``titan-export
--adapter`` (peft loads it on the base) and ``--merge`` (transformers loads it strictly),
both with the trained model's logits within 1e-5, and ``titan-generate`` runs on it.

One training run (module fixture) serves every test; the base folder and the references
are titan_plugins/testing/lora_refs.py's (test_peft_lora.py's too)."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("titan_qwen3")
pytest.importorskip("transformers")
pytest.importorskip("peft")

from titan_plugins.testing.dpo import LN2, REWARDS  # noqa: E402
from titan_plugins.testing.lora_refs import hf_logits, peft_logits, tiny_qwen3_folder  # noqa: E402

SEQ_LEN = 256  # the sample's pairs are 50-220 tokens
TOKENS = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """The tiny random Qwen3 folder (ChatML tokenizer), with room for the pairs."""
    folder = tiny_qwen3_folder(tmp_path_factory.mktemp("dpo_export") / "base")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "max_position_embeddings": SEQ_LEN}))
    return folder


def _args(base, *extra):
    return ["model=qwen3", f"model.hf={base}", "model.attn_backend=sdpa", "peft=lora", "objective=dpo",
            f"training.seq_len={SEQ_LEN}", *extra]


@pytest.fixture(scope="module")
def dpo_run(base):
    """Four pairs of the sample, every step (a toy set the policy can fit), held-out
    pairs validated at the last step, the final step checkpointed (adapters only)."""
    from titan_plugins.data.chat_source import ASSETS
    from titan_plugins.train.api import run

    folder = base.parent
    pairs, held_out = folder / "pairs.jsonl", folder / "held_out.jsonl"
    for out, name in ((pairs, "preference_sample.jsonl"), (held_out, "preference_sample_val.jsonl")):
        out.write_text("".join((ASSETS / name).read_text().splitlines(keepends=True)[:4]))
    run_dir = folder / "run"
    result = run(_args(base, "data=preference", f"data.path={pairs}", "training.steps=8", "training.lr=1e-2",
                       "training.warmup_steps=0", "training.decay=none", "training.local_batch_size=8",
                       "metrics.tensorboard=false", "checkpoint.enabled=true", "validation.enabled=true",
                       "validation.every=8", "validation.steps=1", f"validation.path={held_out}"),
                 run_dir=run_dir, timeout=600)
    assert result.returncode == 0, f"{result.error}\n{result.stderr[-3000:]}"
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return run_dir, result, records


@pytest.mark.slow
def test_lora_dpo_starts_at_ln2_and_learns_the_preference(dpo_run):
    run_dir, result, records = dpo_run
    steps = [r for r in records if "step" in r]
    (val,) = [r for r in records if "validation_step" in r]
    assert val["pairs"] == 4 and set(REWARDS) <= set(val) and val["loss"] > 0  # the held-out pairs' DPO loss
    first, last = steps[0], steps[-1]
    assert [r["step"] for r in steps] == list(range(1, 9))
    assert first["loss"] == LN2 and all(first[k] == 0.0 for k in REWARDS)
    assert set(REWARDS) | {"logps/chosen", "logps/rejected"} <= set(first)
    assert last["rewards/margins"] > 0.0 and last["rewards/chosen"] > last["rewards/rejected"]
    assert last["loss"] < LN2
    out = result.stdout
    assert "reference: the base model (LoRA adapters off, no second copy)" in out  # the header
    assert "pairs 32" in out and "rewards/margins" in out  # the summary: data counts and metrics


def _trained_logits(base, run_dir):
    """The run's model by hand: the base folder + LoRA + the last checkpoint's adapters."""
    from titan_plugins.export.source import find_checkpoint, read_dcp_model
    from titan_plugins.plugins import get_plugin_manager
    from titan_plugins.testing.model_parts import one_process_model
    from titan_plugins.train.api import prepare_job

    spec, job, _ = prepare_job(_args(base, "data=preference_sample"), get_plugin_manager())
    model = one_process_model(spec, job, str(base)).eval()
    _, ckpt = find_checkpoint(run_dir)
    adapters = read_dcp_model(ckpt)
    assert adapters and all(".lora_" in k for k in adapters)  # adapter-only checkpoint
    loaded = model.load_state_dict(adapters, strict=False)
    assert not loaded.unexpected_keys
    with torch.no_grad():
        return model(TOKENS)


@pytest.mark.slow
def test_dpo_run_exports_as_peft_adapter_and_merged_folder(base, dpo_run, tmp_path, capsys):
    from titan_plugins.cli.export import main as export_main

    run_dir, _, _ = dpo_run
    trained = _trained_logits(base, run_dir)
    assert (trained - hf_logits(base, TOKENS)).abs().max().item() > 1e-3  # DPO moved the model: the checks below can fail
    assert export_main([str(run_dir), "--adapter", "--out", str(tmp_path / "adapter")]) == 0
    assert (tmp_path / "adapter" / "adapter_config.json").is_file()
    assert (peft_logits(base, tmp_path / "adapter", TOKENS) - trained).abs().max().item() <= 1e-5
    assert export_main([str(run_dir), "--merge", "--out", str(tmp_path / "merged")]) == 0
    assert (hf_logits(tmp_path / "merged", TOKENS) - trained).abs().max().item() <= 1e-5
    capsys.readouterr()


@pytest.mark.slow
def test_titan_generate_runs_on_the_dpo_run(dpo_run, tmp_path, capsys):
    """titan-generate RUN (the base from model.hf, the adapters from the checkpoint)
    says what the merged export says, greedy, token for token."""
    from titan_plugins.cli.export import main as export_main
    from titan_plugins.cli.generate import main as generate_main

    run_dir, _, _ = dpo_run
    assert export_main([str(run_dir), "--merge", "--out", str(tmp_path / "merged")]) == 0
    capsys.readouterr()
    args = ["--chat", "How does assert work?", "--max-new-tokens", "8", "--ignore-eos"]
    assert generate_main([str(run_dir), *args]) == 0
    ours = capsys.readouterr().out
    assert generate_main(["--hf", str(tmp_path / "merged"), "--model", "qwen3", *args]) == 0
    assert capsys.readouterr().out == ours and ours.strip()
