"""``peft=lora`` on ``model=hf`` with transformers' own module names as targets: the run's
PEFT adapter loads in peft onto the folder and equals the run's merged export."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
api = pytest.importorskip("titan_plugins.train.api")

from titan_hf.testing import reference_model, save_folder  # noqa: E402


@pytest.mark.slow
@pytest.mark.extended
def test_lora_adapter_loads_in_peft_and_equals_the_merged_export(tmp_path):
    folder = save_folder("tiny_qwen3", tmp_path / "qwen3")
    run_dir = tmp_path / "run"
    result = api.run(["model=hf", f"model.hf={folder}", "data=synthetic", "data.vocab_size=256",
                      "training.seq_len=16", "training.steps=2", "training.local_batch_size=2",
                      "training.lr=1e-2", "training.warmup_steps=0", "peft=lora",
                      "peft.target_modules=[q_proj,v_proj,down_proj]", "checkpoint.enabled=true",
                      "checkpoint.export_hf=true"], run_dir=run_dir, timeout=300)
    assert result.ok, f"{result.error}\n{result.stderr[-3000:]}"
    config = json.loads((run_dir / "hf-adapter" / "adapter_config.json").read_text())
    assert sorted({m.rsplit(".", 1)[-1] for m in config["target_modules"]}) == ["down_proj", "q_proj", "v_proj"]
    assert all(m.startswith("model.layers.") for m in config["target_modules"])  # transformers' names

    base = reference_model(folder)
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        start = base(ids).logits
        adapted = peft.PeftModel.from_pretrained(base, run_dir / "hf-adapter").eval()(ids).logits
        merged = reference_model(run_dir / "hf")(ids).logits
    assert (adapted - start).abs().max() > 1e-4  # the adapters trained
    assert (adapted - merged).abs().max() <= 1e-4, float((adapted - merged).abs().max())
