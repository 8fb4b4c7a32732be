"""Bad fine-tuning inputs are one line before launch (issue 49.7): a ``peft.init_from``
adapter whose safetensors file is damaged, one saved for another model's shapes, one aimed
at modules the model does not have, and a chat file in which no row has an assistant turn.
Each is one ``error:`` line naming the file and what is wrong, exit code 2, before any
rank starts, nothing written (titan_plugins/train/prelaunch_peft.py,
titan_plugins/data/chat_trains.py). Adapter folders are written as ``titan-export
--adapter`` writes them (``export/lora.py``), from random adapters; no model.hf needed."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from titan_plugins.config.hydra_glue import model_config
from titan_plugins.errors import ConfigError
from titan_plugins.plugins import get_plugin_manager
from titan_plugins.train.api import prepare_job

TINY = ["model=qwen3", "model.n_layers=1", "model.dim=32", "model.n_heads=2", "model.n_kv_heads=1",
        "model.attn_backend=sdpa", "training.seq_len=16", "training.steps=1", "metrics.tensorboard=false"]
SYNTH = ["data.name=synthetic", "data.vocab_size=96"]
LORA = ["peft=lora", "peft.target_modules=[wq,wv]"]


def _write_adapter(folder: Path, overrides: list[str]) -> dict[str, torch.Tensor]:
    """A PEFT folder of random adapters for the model of ``overrides``, as --adapter writes it."""
    from titan_plugins.export.lora import write_peft_adapter as write
    from titan_plugins.peft.checkpoint import adapter_shapes

    spec, job, _ = prepare_job(overrides, get_plugin_manager())
    gen = torch.Generator().manual_seed(0)
    adapters = {}
    for module, shape in adapter_shapes(spec, job).items():
        *lead, out_f, in_f = shape
        adapters[f"{module}.lora_A.weight"] = torch.randn(*lead, int(job.peft.rank), in_f, generator=gen)
        adapters[f"{module}.lora_B.weight"] = torch.randn(*lead, out_f, int(job.peft.rank), generator=gen)
    folder.mkdir(parents=True)
    write(folder, spec, model_config(job.model, spec), job, adapters)
    return adapters


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """``good``, ``damaged``, ``other-shapes`` (saved for dim=64), ``other-modules`` (its config
    also targets GPT-NeoX's query_key_value) and ``foreign-tensors`` (no target list; tensors
    renamed to modules the model does not have)."""
    root = tmp_path_factory.mktemp("adapters")
    good = root / "good"
    _write_adapter(good, [*TINY, *SYNTH, *LORA])
    _write_adapter(root / "other-shapes", [*TINY[:2], "model.dim=64", *TINY[3:], *SYNTH, *LORA])
    shutil.copytree(good, root / "damaged")
    weights = root / "damaged" / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-40])  # cut short: the header points past the end
    shutil.copytree(good, root / "other-modules")
    cfg_path = root / "other-modules" / "adapter_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["target_modules"] = [*cfg["target_modules"], "query_key_value"]
    cfg_path.write_text(json.dumps(cfg))
    from safetensors.torch import load_file, save_file

    shutil.copytree(good, root / "foreign-tensors")
    cfg_path = root / "foreign-tensors" / "adapter_config.json"
    cfg_path.write_text(json.dumps({**cfg, "target_modules": None}))
    tensors = load_file(str(good / "adapter_model.safetensors"))
    save_file({**tensors, **{k.replace("self_attn.q_proj", "attention.query_key_value"): v.clone()
                             for k, v in tensors.items() if "q_proj" in k}},
              str(root / "foreign-tensors" / "adapter_model.safetensors"))
    return root


@pytest.fixture(scope="module")
def no_assistant(tmp_path_factory):
    """A chat file whose rows hold system and user turns only."""
    path = tmp_path_factory.mktemp("chat") / "no_assistant.jsonl"
    rows = [{"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": f"hello {i}"}]}
            for i in range(12)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture
def no_launch(monkeypatch, tmp_path):
    """titan-run in this process, with every way to start a rank failing the test."""
    import titan_plugins.distributed.launcher as launcher
    import titan_plugins.train.api as api

    def started(*args, **kwargs):
        raise AssertionError("a rank was started")

    monkeypatch.setattr(launcher, "launch", started)
    monkeypatch.setattr(api.subprocess, "Popen", started)
    monkeypatch.chdir(tmp_path)


CASES = {  # case -> (overrides past TINY, what the one line says)
    "damaged": ([*SYNTH, *LORA, "peft.init_from={folders}/damaged"],
                r"peft.init_from=\S+/damaged: adapter_model.safetensors is damaged \(.*(incomplete|truncat)"),
    "other-shapes": ([*SYNTH, *LORA, "peft.init_from={folders}/other-shapes"],
                     r"peft.init_from=\S+/other-shapes: adapter_model.safetensors holds "
                     r"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight of shape \[8, 64\], "
                     r"the model's is \[8, 32\]"),
    "other-modules": ([*SYNTH, *LORA, "peft.init_from={folders}/other-modules"],
                      r"peft.init_from=\S+/other-modules: adapter_config.json targets modules the model does "
                      r"not have: query_key_value \(the model's: .*q_proj"),
    "foreign-tensors": ([*SYNTH, *LORA, "peft.init_from={folders}/foreign-tensors"],
                        r"peft.init_from=\S+/foreign-tensors: adapter_model.safetensors holds adapters for "
                        r"modules the model does not have: model.layers.\*.attention.query_key_value"),
    "no-assistant": (["data=chat", "data.path={no_assistant}", "data.num_workers=0"],
                     r"data.path=\S+/no_assistant.jsonl: no row has an assistant turn to train on \(12 rows, "
                     r"roles: system, user\)"),
}


def _args(case, folders, no_assistant):
    extra, expected = CASES[case]
    return [*TINY, *(a.format(folders=folders, no_assistant=no_assistant) for a in extra)], expected


@pytest.mark.parametrize("case", list(CASES))
def test_each_bad_input_is_one_line_before_any_rank_starts(folders, no_assistant, no_launch, tmp_path, capsys,
                                                          case):
    from titan_plugins.cli.run import main

    args, expected = _args(case, folders, no_assistant)
    before = sorted(p.name for p in tmp_path.iterdir())
    code = main([*args, f"hydra.run.dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("error: "), err
    assert re.search(expected, err[0]), err
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no run directory, nothing written


def test_titan_run_says_it_in_one_line_and_writes_nothing(folders, tmp_path):
    """The real CLI, as a user runs it: the damaged adapter."""
    args, _ = _args("damaged", folders, None)
    run_dir = tmp_path / "run"
    proc = subprocess.run([str(Path(sys.executable).parent / "titan-run"), *args, f"hydra.run.dir={run_dir}"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(err) == 1, proc.stderr[-3000:]
    assert err[0].startswith(f"error: peft.init_from={folders}/damaged: adapter_model.safetensors is damaged (")
    assert "Traceback" not in proc.stderr + proc.stdout and not run_dir.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_a_good_adapter_passes_and_reads_back_as_written(folders, tmp_path):
    """The checks refuse nothing they should take: the good folder prepares, and what the
    ranks read (read_peft_adapter) is the adapters it was written from."""
    from titan_plugins.peft.checkpoint import adapter_shapes
    from titan_plugins.peft.folder import read_peft_adapter

    written = _write_adapter(tmp_path / "again", [*TINY, *SYNTH, *LORA])
    spec, job, _ = prepare_job([*TINY, *SYNTH, *LORA, f"peft.init_from={tmp_path / 'again'}"], get_plugin_manager())
    read = read_peft_adapter(spec, model_config(job.model, spec), job.peft, job.peft.init_from,
                             adapter_shapes(spec, job))
    assert read.keys() == written.keys()
    assert all(torch.equal(read[k], written[k]) for k in written)


def test_expert_adapters_pass_the_checks_and_read_back():
    """Grouped MoE expert adapters (one PEFT pair per expert) are modules the model has."""
    import tempfile

    from titan_plugins.peft.checkpoint import adapter_shapes
    from titan_plugins.peft.folder import read_peft_adapter

    args = ["model=deepseek_v3", "training.seq_len=16", *SYNTH, "peft=lora", "peft.target_modules=[experts,wq]"]
    with tempfile.TemporaryDirectory() as tmp:
        written = _write_adapter(Path(tmp) / "moe", args)
        spec, job, _ = prepare_job([*args, f"peft.init_from={tmp}/moe"], get_plugin_manager())
        read = read_peft_adapter(spec, model_config(job.model, spec), job.peft, job.peft.init_from,
                                 adapter_shapes(spec, job))
    assert any(v.ndim == 3 for v in written.values())
    assert read.keys() == written.keys() and all(torch.equal(read[k], written[k]) for k in written)


def test_a_chat_file_whose_assistant_turns_come_late_passes(tmp_path):
    """The check reads on past rows without an assistant turn (the run skips them)."""
    from types import SimpleNamespace

    from titan_plugins.data.chat_source import CHAT_TOKENIZER
    from titan_plugins.data.check import check_data_source

    rows = [{"messages": [{"role": "user", "content": f"q {i}"}]} for i in range(40)]
    rows.append({"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]})
    path = tmp_path / "late.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = SimpleNamespace(name="chat", path=str(path), split="train", tokenizer=str(CHAT_TOKENIZER),
                           num_workers=0, chat={})
    check_data_source(data)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows[:-1]))
    with pytest.raises(ConfigError, match=r"^data.path=\S+late.jsonl: no row has an assistant turn .*40 rows"):
        check_data_source(data)
    mix = SimpleNamespace(name="mix", path=None, split="train", tokenizer=str(CHAT_TOKENIZER), num_workers=0,
                          chat={}, mix=[{"name": "chat", "path": str(path), "weight": 1}])
    with pytest.raises(ConfigError, match=r"^data.mix\[0\].path=\S+late.jsonl: no row has an assistant turn"):
        check_data_source(mix)
