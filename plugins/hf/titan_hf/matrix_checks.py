"""The matrix's checks beyond training, for a type equal on one rank (``titan_hf.matrix_runs``):
what a user does with the trained model next, each against transformers (and peft).

- :func:`export_check`: the full export (``titan_plugins.hf.export_model``) of our model
  with weights changed loads strictly in transformers and gives our loss;
- :func:`lora_check`: ``peft=lora`` (its default targets), adapters nonzero, exported as
  a run does at its end (``export_lora_live``): the PEFT adapter loads in peft onto the
  folder and the merged folder loads strictly, both with our LoRA model's loss;
- :func:`generation_check`: greedy decoding through our KV-cache path gives transformers'
  ``generate`` tokens.

Each returns one cell: ``equal``, ``differ: <what>``; :func:`run_checks` turns an exception
into ``refused: <the ConfigError line>`` or ``error: <one line>``, so a failing check
costs its own cell only.
"""

from __future__ import annotations

import contextlib
import io
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from titan_plugins.errors import ConfigError

__all__ = ["CHECKS", "GEN_TOKENS", "PROMPT", "export_check", "generation_check", "lora_check", "run_checks"]

#: greedy decoding: this prompt, GEN_TOKENS new tokens (prompt + new > the tiny folders' sliding window 8)
PROMPT = torch.randint(3, 256, (1, 6), generator=torch.Generator().manual_seed(2))
GEN_TOKENS = 8
CHECKS = ("export", "lora", "generation")


def _cell_of(check: Callable[..., str], *args: Any) -> str:
    """``check(*args)``, or its exception as one line (a ``ConfigError`` is ``refused``;
    a crash names where it was raised, ``(at peft/lora.py:84)``)."""
    from titan_hf.matrix_runs import one_line

    try:
        return check(*args)
    except ConfigError as exc:
        return f"refused: {one_line(exc)}"
    except Exception as exc:  # noqa: BLE001 - one line per cell, never a traceback
        import traceback

        frames = traceback.extract_tb(exc.__traceback__)
        where = f" (at {'/'.join(Path(frames[-1].filename).parts[-2:])}:{frames[-1].lineno})" if frames else ""
        return f"error: {one_line(exc, 240 - len(where))}{where}"


def run_checks(ours: torch.nn.Module, folder: Path, work: Path) -> dict[str, str]:
    """The three cells of a type equal on one rank (``ours``: the model ``load_hf_model``
    returned for ``folder``; exports go under ``work``). Generation runs first: the export
    check changes ``ours``' weights (and puts them back)."""
    return {
        "generation": _cell_of(generation_check, ours, folder),
        "export": _cell_of(export_check, ours, folder, work / "export"),
        "lora": _cell_of(lora_check, folder, work / "lora"),
    }


# ------------------------------------------------------------------ shared
def _packed(model: torch.nn.Module, inputs: torch.Tensor) -> dict[str, Any]:
    """transformers' arguments for the rows our model reads as packed documents (as
    ``titan_hf.verify.compare``)."""
    if not getattr(model, "block_causal", False):
        return {}
    from titan_hf.model import document_positions
    from titan_plugins.components.attention_masks import document_ids

    return {"position_ids": document_positions(document_ids(inputs, model.eos_id)), "use_cache": False}


@torch.no_grad()
def _loss(model: torch.nn.Module, *, hf: dict[str, Any] | None = None) -> float:
    """The matrix batch's loss (eval mode): ours, or transformers' with ``hf`` its extra arguments."""
    from titan_hf.matrix_runs import _batch

    inputs, labels = _batch()
    model.eval()
    logits = model(inputs, **hf).logits if hf is not None else model(inputs)
    return float(F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten()))


def _attn(folder: Path) -> str:
    import json

    from titan_hf.architecture import attn_implementation, causal_lm_class

    return attn_implementation(causal_lm_class(json.loads((folder / "config.json").read_text())["model_type"]),
                               "auto")


def _strict(folder: Path, kernel_of: Path) -> tuple[torch.nn.Module, str]:
    """transformers' model of an exported ``folder`` (the kernel ``kernel_of``'s type
    runs) and what its loading found wrong ('' if nothing: tied weights are not missing)."""
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True, dtype=torch.float32,
                                                       attn_implementation=_attn(kernel_of))
    wrong = [f"{key.replace('_keys', '')} {', '.join(sorted(map(str, v))[:3])}" for key, v in info.items() if v]
    return model.eval(), "; ".join(wrong)


def _verdict(what: str, mine: float, theirs: float) -> str | None:
    """``None`` if the losses agree within ``EQUAL_LOSS``, else the ``differ`` line."""
    from titan_hf.matrix_runs import EQUAL_LOSS

    diff = abs(mine - theirs)
    return None if diff <= EQUAL_LOSS else f"differ: {what} loss {theirs:.6g} vs ours {mine:.6g} ({diff:.1e})"


def _batch_inputs() -> torch.Tensor:
    from titan_hf.matrix_runs import _batch

    return _batch()[0]


def _fresh(out: Path) -> Path:
    if out.exists():  # an earlier matrix run's export: the checks write their own
        shutil.rmtree(out)
    return out


# ------------------------------------------------------------------ the checks
def export_check(ours: torch.nn.Module, folder: Path, out: Path) -> str:
    """Full export: every parameter moved a little (so the folder must carry our values,
    not the source's), ``export_model`` to ``out``, loaded strictly by transformers:
    nothing missing, unexpected or mismatched, and our loss within ``EQUAL_LOSS``.
    ``ours`` gets its own weights back."""
    from titan_plugins.hf import export_model

    saved = {name: p.detach().clone() for name, p in ours.named_parameters()}
    try:
        gen = torch.Generator().manual_seed(5)
        with torch.no_grad():
            for p in ours.parameters():
                if p.is_floating_point():
                    p.add_(torch.randn(p.shape, generator=gen).to(p.dtype) * 0.02)
        mine = _loss(ours)
        export_model(ours, "hf", _fresh(out))
        theirs, wrong = _strict(out, folder)
        if wrong:
            return f"differ: transformers' loading: {wrong}"
        return _verdict("transformers'", mine, _loss(theirs, hf=_packed(ours, _batch_inputs()))) or "equal"
    finally:
        with torch.no_grad():
            for name, p in ours.named_parameters():
                p.copy_(saved[name])


def lora_check(folder: Path, work: Path) -> str:
    """LoRA: ``peft=lora`` (default targets) on ``folder`` as a one-rank run builds it,
    every B set nonzero (it starts at 0: the adapters would change nothing), exported as
    ``checkpoint.export_hf=true`` does (``export_lora_live``: ``<run>/hf`` merged,
    ``<run>/hf-adapter`` PEFT). peft's ``PeftModel.from_pretrained`` on transformers'
    model of ``folder`` and the merged folder (loaded strictly) give our loss within
    ``EQUAL_LOSS``. No adapter folder (adapted experts without a PEFT layout) is
    ``refused: <the export's line>`` once the merged folder is equal."""
    from titan_plugins.config.hydra_glue import model_config
    from titan_plugins.export.lora import adapter_out_dir, export_lora_live
    from titan_plugins.peft.lora import adapter_modules
    from titan_plugins.plugins import get_plugin_manager
    from titan_plugins.testing.model_parts import one_process_model
    from titan_plugins.train.api import prepare_job

    spec, job, _ = prepare_job(["model=hf", f"model.hf={folder}", "data=synthetic", "data.vocab_size=256",
                                "peft=lora"], get_plugin_manager())
    model = one_process_model(spec, job, str(folder)).eval()
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for _, pair in adapter_modules(model):
            pair.lora_B.weight.copy_(torch.randn(pair.lora_B.weight.shape, generator=gen) * 0.1)
    mine = _loss(model)
    run_dir = _fresh(work)
    run_dir.mkdir(parents=True)
    said = io.StringIO()
    with contextlib.redirect_stdout(said):
        merged = export_lora_live(spec, model_config(job.model, spec), job, model.state_dict(), run_dir / "hf",
                                  run_dir)
    hf = _packed(model, _batch_inputs())
    theirs, wrong = _strict(merged, folder)
    if wrong:
        return f"differ: merged folder's loading: {wrong}"
    if (line := _verdict("merged folder's", mine, _loss(theirs, hf=hf))) is not None:
        return line
    adapter = adapter_out_dir(run_dir / "hf")
    if not adapter.is_dir():
        why = said.getvalue().strip().splitlines()
        return "refused: " + (why[-1].split(": ", 2)[-1] if why else f"no {adapter.name} written")
    return _peft_verdict(folder, adapter, mine, hf)


def _peft_verdict(folder: Path, adapter: Path, mine: float, hf: dict[str, Any]) -> str:
    """peft's model of ``adapter`` on transformers' ``folder``: ``equal`` or the ``differ`` line."""
    import peft

    from titan_hf.testing import reference_model

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = peft.PeftModel.from_pretrained(reference_model(folder), adapter)
    # peft reports adapter weights it did not load (or loaded nowhere) as warnings only
    missing = [" ".join(str(w.message).split()) for w in caught
               if any(k in str(w.message).lower() for k in ("missing", "unexpected"))]
    line = _verdict("peft's", mine, _loss(model, hf=hf))
    if not missing:
        return line or "equal"
    return ((line + "; " if line else "differ: ") + f"peft's loading: {missing[0]}")[:300]


def generation_check(ours: torch.nn.Module, folder: Path) -> str:
    """Greedy decoding of ``GEN_TOKENS`` tokens from ``PROMPT``: ours through the KV cache
    (``titan_plugins.generate.generate``, no EOS stop) against transformers' ``generate``
    (EOS stopping off): ``equal`` if the ids are identical, else the first that is not."""
    from titan_hf.testing import reference_model
    from titan_plugins.generate import SamplingConfig, generate, supports_generation

    if not supports_generation(ours):
        raise ConfigError(f"{type(ours).__name__}.forward takes no cache=: no KV-cache generation")
    mine = generate(ours, PROMPT, SamplingConfig(max_new_tokens=GEN_TOKENS))[0].tolist()
    theirs = reference_model(folder)
    theirs.generation_config.eos_token_id = None
    with torch.no_grad():
        out = theirs.generate(PROMPT, attention_mask=torch.ones_like(PROMPT), do_sample=False,
                              max_new_tokens=GEN_TOKENS, pad_token_id=0)
    ref = out[0, PROMPT.shape[1]:].tolist()
    if mine == ref:
        return "equal"
    if len(mine) != len(ref) and mine[:min(len(mine), len(ref))] == ref[:min(len(mine), len(ref))]:
        return f"differ: {len(mine)} tokens vs transformers' {len(ref)}"
    first = next(k for k, (a, b) in enumerate(zip(mine, ref, strict=False)) if a != b)
    return f"differ: first at token {first} ({mine[first]} vs transformers' {ref[first]})"
