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
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from titan_hf.config import FLAVORS

__all__ = ["reference_model", "save_folder", "train_configs_in_one_launch", "train_in_one_launch"]


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
    here first (a ``ConfigError`` before any rank starts), then trained by
    :func:`train_configs_in_one_launch`. Returns ``name -> (losses, config path)``; raises
    ``RuntimeError`` naming the first job that failed and its error line."""
    from titan_plugins.plugins import get_plugin_manager
    from titan_plugins.train.api import prepare_job
    from titan_plugins.train.run_files import write_config

    alone, ranks = dict(alone or {}), dict(ranks or {})
    work = Path(work)
    pm = get_plugin_manager(strict=True)
    configs = {name: write_config(prepare_job(list(argv), pm, run_dir=work / name)[1], work / name)
               for name, argv in {**alone, **ranks}.items()}
    losses, failed = train_configs_in_one_launch(work, world=world, alone={n: configs[n] for n in alone},
                                                 ranks={n: configs[n] for n in ranks}, timeout=timeout)
    if failed:
        name, rank, why = failed
        raise RuntimeError(f"{name} (rank {rank}): {why}")
    return {name: (values, configs[name]) for name, values in losses.items()}


def train_configs_in_one_launch(
    work: str | Path, *, world: int, alone: Mapping[str, Path], ranks: Mapping[str, Path], timeout: float,
) -> tuple[dict[str, list[float]], tuple[str, int, str] | None]:
    """Train already composed jobs (``name -> config.yaml`` written by ``write_config``) in
    one launched job in ``work``: ``alone`` on rank 0 (a world of one), then ``ranks`` on
    ``world`` gloo ranks. Returns ``name -> step losses`` of the jobs that trained and, where
    one did not, ``(its name, rank, why)``: the earliest error a rank recorded, else ``timed
    out after ...`` or ``a rank died`` with rank 0's last log line. A failure ends the launch,
    so the jobs after it have no losses. ``timeout``: seconds the launch may go without
    finishing a job (also the ranks' rendezvous and collective timeout).

    The ranks are the core's loss-parity ranks (``titan_plugins.testing.conformance._parity_ranks``)
    running the core's ``Trainer``; they fork from the warm process that launches jobs
    (``train.zygote``): torch, transformers and the plugins import once."""
    from titan_plugins.testing.conformance.parity import launch_parity_ranks

    work = Path(work)
    work.mkdir(parents=True, exist_ok=True)
    names = [*alone, "cases"]  # by group: a one-rank job is recorded as its group's "base"
    plan = {"dir": str(work), "timeout": timeout,
            "groups": [*({"base": str(config), "cases": []} for config in alone.values()),
                       {"base": None, "cases": [[n, str(config)] for n, config in ranks.items()]}]}
    plan_path = work / "plan.json"
    plan_path.write_text(json.dumps(plan))
    size = world if ranks else 1
    paths = [p for p in sys.path if p and os.path.isdir(p)]  # this interpreter's imports, test dirs included
    env = {"OMP_NUM_THREADS": "1", **os.environ, "MASTER_ADDR": "127.0.0.1",
           "WORLD_SIZE": str(size), "PYTHONPATH": os.pathsep.join(paths)}
    records, timed_out = launch_parity_ranks(plan_path, work, env, [work / f"rank{r}.log" for r in range(size)],
                                             timeout, progress=True)
    for r in records:
        r["name"] = names[r["group"]] if r["what"] == "base" else r["what"]
    losses = {r["name"]: r["losses"] for r in records if "losses" in r}
    errors = sorted((r for r in records if "error" in r), key=lambda r: r["time"])
    if errors:  # the earliest: a peer's later error is usually "connection closed"
        return losses, (errors[0]["name"], errors[0]["rank"], errors[0]["error"])
    missing = [n for n in [*alone, *ranks] if n not in losses]
    if not missing:
        return losses, None
    tail = [line for line in (work / "rank0.log").read_text().splitlines() if line.strip()][-1:]
    why = f"timed out after {timeout:g} s" if timed_out else "a rank died"
    return losses, (missing[0], 0, why + (f" (rank 0 log: {tail[0][:160]})" if tail else ""))
