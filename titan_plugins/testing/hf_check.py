"""Hugging Face checks for plugin tests.

- ``check_hf_round_trip`` (the kit's self-consistency contract) and
  ``check_hf_transformers`` (logits and config.json against transformers' own model,
  where transformers knows the architecture); both kept importable here.
- :func:`check_export_is_trained_model`: train a few steps from a saved (random)
  transformers model with ``model.hf``, export by both routes (``checkpoint.export_hf``
  at the end of the run and ``titan-export`` from the DCP checkpoint), and compare the
  exported folders in transformers with the trained model: loss, greedy generation
  (stopping at the folder's EOS ids), strict loading, and what the folder said that
  the run did not change (config.json fields, special-token ids, side files).

Needs ``transformers`` (a test-only reference); nothing is downloaded.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from titan_plugins.testing.conformance.hf import check_hf_round_trip, check_hf_transformers

__all__ = ["check_export_is_trained_model", "check_hf_round_trip", "check_hf_transformers", "greedy"]


def greedy(forward: Any, prompt: Any, eos: set[int], max_new: int) -> list[int]:
    """Greedy decoding with full forwards (no cache): ``forward(ids[1, T]) -> logits``;
    stops after an EOS id or ``max_new`` tokens."""
    import torch

    ids = prompt.clone()
    for _ in range(max_new):
        with torch.no_grad():
            nxt = int(forward(ids)[0, -1].argmax())
        ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
        if nxt in eos:
            break
    return ids[0].tolist()


def _loss(logits: Any, tokens: Any) -> float:
    import torch.nn.functional as F

    return float(F.cross_entropy(logits[:, :-1].flatten(0, 1).double(), tokens[:, 1:].flatten()))


def check_export_is_trained_model(
    model_name: str,
    folder: str | Path,
    work: str | Path,
    overrides: Sequence[str] = (),
    *,
    hf_attn: str = "eager",
    steps: int = 3,
    max_new: int = 6,
    timeout: float = 300,
) -> dict[str, Any]:
    """Train ``steps`` steps of ``model=model_name`` from ``folder`` on one rank, export
    both ways into ``work``, and check each export against the trained model in
    transformers (``AssertionError`` naming what differs). Returns what was measured:
    ``loss_diff``/``logits_diff`` (largest over both exports), ``generated`` (the greedy
    continuations), ``config`` (the exported config.json) and ``moved`` (how far the
    trained weights moved from the folder's, largest abs difference of the logits)."""
    import torch
    import transformers

    from titan_plugins.cli.export import main as export_main
    from titan_plugins.config.hydra_glue import model_config
    from titan_plugins.plugins import get_plugin_manager
    from titan_plugins.train.api import prepare_job, run

    folder, work = Path(folder), Path(work)
    run_dir = work / "run"
    base = [f"model={model_name}", f"model.hf={folder}", *overrides]
    result = run(
        [*base, f"training.steps={steps}", "training.local_batch_size=2", "checkpoint.enabled=true",
         "checkpoint.export_hf=true", "training.dump_final_params=true", "metrics.tensorboard=false"],
        run_dir=run_dir, timeout=timeout,
    )
    assert result.returncode == 0, f"{result.error}\n{result.stderr[-3000:]}"
    assert "sizes and weights from model.hf=" in result.stdout, result.stdout[-2000:]
    assert export_main([str(run_dir), "--out", str(work / "exported")]) == 0

    pm = get_plugin_manager()
    spec, job, _ = prepare_job(base, pm)
    cfg = model_config(job.model, spec)
    ours = spec.load("build")(cfg)
    ours.load_state_dict(torch.load(run_dir / "final_params.pt"), strict=True)
    ours.eval()
    source = json.loads((folder / "config.json").read_text())
    # A released folder's two files may differ (Qwen3: config.json eos 151645,
    # generation_config.json [151645, 151643]); each is written back as it was.
    source_gen_path = folder / "generation_config.json"
    source_gen = json.loads(source_gen_path.read_text()) if source_gen_path.is_file() else source
    vocab = int(cfg.vocab_size)
    tokens = torch.randint(0, vocab, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want_logits = ours(tokens)
    want_loss = _loss(want_logits, tokens)
    start = transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation=hf_attn).eval()
    with torch.no_grad():
        moved = float((start(tokens).logits - want_logits).abs().max())
    assert moved > 1e-4, "the run did not move the weights: the check would not see a stale export"

    measured: dict[str, Any] = {"loss_diff": 0.0, "logits_diff": 0.0, "moved": moved}
    for out in (run_dir / "hf", work / "exported"):
        model, info = transformers.AutoModelForCausalLM.from_pretrained(
            out, output_loading_info=True, attn_implementation=hf_attn)
        assert not any(info.values()), (out, info)  # nothing missing, unexpected or mismatched
        model.eval()
        with torch.no_grad():
            got = model(tokens).logits
        measured["logits_diff"] = max(measured["logits_diff"], float((got - want_logits).abs().max()))
        measured["loss_diff"] = max(measured["loss_diff"], abs(_loss(got, tokens) - want_loss))
        config = json.loads((out / "config.json").read_text())
        gen_config = json.loads((out / "generation_config.json").read_text())
        eos = gen_config.get("eos_token_id")
        eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
            if source.get(key) is not None:  # what the folder said is written back unchanged
                assert config.get(key) == source[key], (out, key, config.get(key), source[key])
            if source_gen.get(key) is not None:
                assert gen_config.get(key) == source_gen[key], (out, key, gen_config.get(key), source_gen[key])
        assert all(0 <= i < vocab for i in eos_ids), (out, eos_ids, vocab)
        generated = []
        for row in range(tokens.shape[0]):
            prompt = tokens[row : row + 1, :4]
            mine = greedy(ours, prompt, eos_ids, max_new)
            theirs = model.generate(prompt, max_new_tokens=max_new, do_sample=False,
                                    attention_mask=torch.ones_like(prompt))[0].tolist()
            assert mine == theirs, (out, mine, theirs)
            generated.append(mine)
        measured["generated"], measured["config"] = generated, config
        weights = sorted(out.glob("*.safetensors"))
        assert weights and all(os.stat(w).st_mode & 0o044 for w in weights), "weights not readable by others"
        assert (out / "tokenizer_config.json").is_file() == (out / "tokenizer.json").is_file()
    assert measured["loss_diff"] <= 1e-5 and measured["logits_diff"] <= 1e-4, measured
    return measured
