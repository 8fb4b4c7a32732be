"""Tiny random Hugging Face folders for tests (nothing is downloaded).

    folder = save_folder("tiny_mistral", tmp_path / "mistral")   # config.json + model.safetensors

The flavor's config.json is built by transformers with random weights (normal, std
``std``: every weight matters, unlike HF's near-zero init) and written with
``save_pretrained``, so the folder is what a user's checkpoint looks like.

:func:`train_in_one_launch` trains several ``titan-run`` jobs in one launched job (the
core's loss-parity ranks), so a matrix of layouts costs one start of the interpreters.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from titan_hf.config import FLAVORS

__all__ = ["reference_model", "save_folder", "train_in_one_launch"]


def save_folder(flavor: str, folder: str | Path, *, seed: int = 0, std: float = 0.2,
                **overrides: Any) -> Path:
    """Write flavor ``flavor`` (``titan_hf.config.FLAVORS``) as a transformers folder."""
    from transformers import AutoModelForCausalLM

    from titan_hf.model import hf_config_object

    config = FLAVORS[flavor]
    hf = hf_config_object(config)
    for key, value in overrides.items():
        setattr(hf, key, value)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf, attn_implementation=hf._attn_implementation)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and p.dim() == 1:
                p.normal_(1.0 if "gemma" not in hf.model_type else 0.0, std)
            else:
                p.normal_(0.0, std)
    folder = Path(folder)
    model.save_pretrained(folder)
    return folder


def reference_model(folder: str | Path, attn: str | None = None) -> torch.nn.Module:
    """The plain transformers model of ``folder`` (fp32, eval; the kernel ``model=hf``
    picks by default: SDPA where the architecture has it, else eager)."""
    import json

    from transformers import AutoModelForCausalLM

    from titan_hf.architecture import attn_implementation, causal_lm_class

    model_type = json.loads((Path(folder) / "config.json").read_text())["model_type"]
    attn = attn or attn_implementation(causal_lm_class(model_type), "auto")
    return AutoModelForCausalLM.from_pretrained(folder, attn_implementation=attn, dtype=torch.float32).eval()


def train_in_one_launch(work: str | Path, *, world: int, alone: Mapping[str, Sequence[str]] | None = None,
                        ranks: Mapping[str, Sequence[str]] | None = None,
                        timeout: float = 600) -> dict[str, tuple[list[float], Path]]:
    """Train every job of ``alone`` (one rank, world of one) and of ``ranks`` (on ``world``
    gloo ranks) in one launched job: ``name -> titan-run overrides``, composed and validated
    here first (a ``ConfigError`` before any rank starts). Returns ``name -> (losses, config
    path)``; raises ``RuntimeError`` naming the first job that failed and its error line.

    The ranks are the core's loss-parity ranks (``titan_plugins.testing.conformance._parity_ranks``):
    rank 0 trains the ``alone`` jobs first, then all ranks train the others in turn with the
    core's ``Trainer``; the ranks fork from the warm process that launches jobs
    (``train.zygote``): torch, transformers and the plugins import once."""
    from titan_plugins.plugins import get_plugin_manager
    from titan_plugins.train.api import prepare_job
    from titan_plugins.train.run_files import write_config
    from titan_plugins.train.zygote import popen_module

    alone, ranks = dict(alone or {}), dict(ranks or {})
    work = Path(work)
    work.mkdir(parents=True, exist_ok=True)
    pm = get_plugin_manager(strict=True)
    configs = {name: write_config(prepare_job(list(argv), pm, run_dir=work / name)[1], work / name)
               for name, argv in {**alone, **ranks}.items()}
    names = [*alone, "cases"]
    plan = {"dir": str(work), "timeout": timeout,
            "groups": [*({"base": str(configs[n]), "cases": []} for n in alone),
                       {"base": None, "cases": [[n, str(configs[n])] for n in ranks]}]}
    plan_path = work / "plan.json"
    plan_path.write_text(json.dumps(plan))
    (work / "rendezvous-port").unlink(missing_ok=True)  # rank 0 publishes this launch's (testing.gloo.rendezvous_store)
    paths = [p for p in sys.path if p and os.path.isdir(p)]  # this interpreter's imports, test dirs included
    env = {"OMP_NUM_THREADS": "1", **os.environ, "MASTER_ADDR": "127.0.0.1",
           "WORLD_SIZE": str(world), "PYTHONPATH": os.pathsep.join(paths)}
    procs = []
    for rank in range(world):
        (work / f"results-rank{rank}.jsonl").unlink(missing_ok=True)
        with open(work / f"rank{rank}.log", "w") as log:  # forked warm where it can (train.zygote)
            procs.append(popen_module("titan_plugins.testing.conformance._parity_ranks", [str(plan_path)],
                                      env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                                      stdout=log.fileno(), stderr=log.fileno()))
    deadline = time.monotonic() + timeout
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        if any(p.returncode not in (None, 0) for p in procs):
            time.sleep(2.0)  # the peer records its own error, then it is stopped
            break
        time.sleep(0.2)
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()
    records = [json.loads(line) for rank in range(world) if (work / f"results-rank{rank}.jsonl").is_file()
               for line in (work / f"results-rank{rank}.jsonl").read_text().splitlines() if line.strip()]
    for r in records:  # a one-rank job is recorded as its group's "base"
        r["name"] = names[r["group"]] if r["what"] == "base" else r["what"]
    errors = sorted((r for r in records if "error" in r), key=lambda r: r["time"])
    if errors:
        raise RuntimeError(f"{errors[0]['name']} (rank {errors[0]['rank']}): {errors[0]['error']}")
    out = {r["name"]: (r["losses"], configs[r["name"]]) for r in records if "losses" in r}
    missing = [n for n in configs if n not in out]
    if missing:
        log = (work / "rank0.log").read_text()[-2000:]
        raise RuntimeError(f"{missing[0]}: no result (timed out after {timeout:g} s or a rank died): {log}")
    return out
