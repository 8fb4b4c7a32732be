"""``titan-run model=hf model.hf=DIR`` through the real trainer (launched ranks, gloo):

- one rank's step-1 loss equals the plain transformers model's on the same batch;
- fsdp2 and fsdp2_tp2 (sequence parallel on) equal one rank within 1e-5 over 3 steps.

On tiny Gemma 3 (tied embeddings, scaled embedding buffer, sliding + full layers,
per-head q/k norms whose TP gradient must be summed): the structure most likely to
break a generic wrapper. Every run starts from the folder's weights, so no seed
checkpoint is needed.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
api = pytest.importorskip("titan_plugins.train.api")
from titan_hf.testing import reference_model, save_folder  # noqa: E402

from titan_plugins.compare.runner import match_global_batch  # noqa: E402

STEPS = 3
COMMON = ["model=hf", "data=synthetic", "data.vocab_size=256", f"training.steps={STEPS}",
          "training.deterministic=true", "training.seq_len=16", "training.local_batch_size=4",
          "training.lr=1e-3", "training.warmup_steps=0"]
TIMEOUT = 300


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    work = tmp_path_factory.mktemp("hf_parallel")
    folder = save_folder("tiny_gemma3", work / "gemma3")
    out = {}
    for name, layout in (("single", "single"), ("fsdp2", "fsdp2"), ("fsdp2_tp2", "fsdp2_tp2")):
        base = [*COMMON, f"model.hf={folder}", "parallelism=single"]
        overrides, _ = match_global_batch(base, [*COMMON, f"model.hf={folder}", f"parallelism={layout}"])
        result = api.run(overrides, run_dir=work / name, timeout=TIMEOUT)
        assert result.ok, f"{name}: {result.error}\n{result.stderr[-3000:]}"
        assert len(result.losses) == STEPS
        out[name] = result
    return folder, out


def _first_batch(result) -> torch.Tensor:
    """The ids of one rank's first step, rebuilt from its resolved config."""
    from omegaconf import OmegaConf

    from titan_plugins.plugins import get_plugin_manager
    from titan_plugins.train.data import build_dataloader, build_tokenizer

    job = OmegaConf.load(result.run_dir / "config.yaml")
    data = job.data
    loader = build_dataloader(data, build_tokenizer(data), dp_rank=0, dp_world=1,
                              local_batch_size=int(job.training.local_batch_size),
                              seq_len=int(job.training.seq_len), seed=int(job.training.seed),
                              datasets=get_plugin_manager().datasets(),
                              grad_accum_steps=int(job.training.grad_accum_steps))
    batch = next(iter(loader))
    return batch[0], batch[1]


@pytest.mark.slow
def test_step1_loss_equals_transformers(runs):
    folder, out = runs
    inputs, labels = _first_batch(out["single"])
    ref = reference_model(folder)
    with torch.no_grad():
        logits = ref(inputs).logits
    want = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100)
    assert abs(out["single"].losses[0] - float(want)) <= 1e-5, (out["single"].losses[0], float(want))


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["fsdp2", "fsdp2_tp2"])
def test_layout_equals_one_rank(runs, layout):
    _, out = runs
    base, got = out["single"].losses, out[layout].losses
    assert max(abs(a - b) for a, b in zip(base, got, strict=True)) <= 1e-5, (base, got)
    assert base[0] != base[-1]  # it trained


@pytest.mark.slow
@pytest.mark.extended
def test_moe_pp2_and_fsdp2_ac_equal_one_rank(tmp_path):
    """GPT-OSS (fused MoE experts, sinks, sliding + full layers, eager attention): pp2
    (embeddings first, norm + head last, rotary on both stages) and fsdp2 with full
    activation checkpointing equal one rank within 1e-5 over 3 steps."""
    folder = save_folder("tiny_gpt_oss", tmp_path / "gpt_oss")
    base = [*COMMON, f"model.hf={folder}", "parallelism=single"]
    single = api.run(base, run_dir=tmp_path / "single", timeout=TIMEOUT)
    assert single.ok, single.error
    for name, layout in (("pp2", ["parallelism=pp2"]),
                         ("fsdp2_ac", ["parallelism=fsdp2", "training.activation_checkpoint=full"])):
        overrides, _ = match_global_batch(base, [*COMMON, f"model.hf={folder}", *layout])
        result = api.run(overrides, run_dir=tmp_path / name, timeout=TIMEOUT)
        assert result.ok, f"{name}: {result.error}"
        diff = max(abs(a - b) for a, b in zip(single.losses, result.losses, strict=True))
        assert diff <= 1e-5, (name, single.losses, result.losses)
