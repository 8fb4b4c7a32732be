"""One matrix row: a ``model_type`` classified, built, and trained one step against
transformers (one rank, in process); :func:`launch_jobs` trains composed ``titan-run``
jobs on gloo ranks for the layout columns (``titan_hf.matrix_layouts``).

Every failure is caught and kept as one line: ``refused`` is a ``ConfigError`` (the
plugin's own one-line refusal, before launch), ``error`` anything else (a crash),
``untested`` a type for which transformers itself cannot build or load a tiny folder.
An equal type's row also holds the export, LoRA and generation cells
(``titan_hf.matrix_checks``), each failing alone.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from titan_plugins.errors import ConfigError

__all__ = ["EQUAL_GRAD", "EQUAL_LOSS", "launch_jobs", "one_line", "one_rank"]

#: one rank equals transformers: step-1 loss within EQUAL_LOSS (absolute, fp32) and every
#: parameter's gradient norm within EQUAL_GRAD (relative)
EQUAL_LOSS = 1e-5
EQUAL_GRAD = 1e-4


def one_line(exc: BaseException, limit: int = 240) -> str:
    """``Type: message`` on one line (``ConfigError``: the message alone)."""
    text = " ".join(line.strip() for line in str(exc).splitlines() if line.strip())
    if not isinstance(exc, ConfigError):
        text = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(3, 256, (2, 25), generator=torch.Generator().manual_seed(1))  # > sliding window 8
    return ids[:, :-1], ids[:, 1:]


def one_rank(model_type: str, work: str | Path) -> dict[str, Any]:
    """The one-rank row of ``model_type``: ``{"type", "class", "builds", "status",
    "reason", "loss", "diff", "grad", "verify_stops"}``, and for an equal type ``"checks"``:
    ``{"export", "lora", "generation"}`` cells (``titan_hf.matrix_checks``)."""
    from transformers import AutoConfig

    from titan_hf.architecture import check_architecture

    row: dict[str, Any] = {"type": model_type, "class": "", "builds": None, "status": "error", "reason": ""}
    try:
        default = AutoConfig.for_model(model_type)
        row["class"] = check_architecture({"model_type": model_type,
                                           "is_encoder_decoder": getattr(default, "is_encoder_decoder", False)}).__name__
    except ConfigError as exc:
        return {**row, "status": "refused", "reason": one_line(exc)}
    except Exception as exc:  # noqa: BLE001 - transformers' default config does not build
        return {**row, "status": "untested", "reason": f"transformers' default config: {one_line(exc)}"}
    return _one_rank(row, model_type, Path(work))


def _one_rank(row: dict[str, Any], model_type: str, work: Path) -> dict[str, Any]:
    from titan_hf.matrix_folders import tiny_folder
    from titan_hf.testing import reference_model

    try:
        folder = tiny_folder(model_type, work / model_type)
    except Exception as exc:  # noqa: BLE001
        return {**row, "status": "untested", "reason": f"no tiny folder: {one_line(exc)}"}
    stage = "build"
    try:
        from titan_hf.config import TESTED, AttnImpl, HFModelConfig, config_from_hf
        from titan_hf.model import build

        values = config_from_hf(json.loads((folder / "config.json").read_text()))
        config = HFModelConfig(**{**values, "attn_implementation": AttnImpl.auto})
        with torch.device("meta"):
            build(config)
        row["builds"] = True
        from titan_hf.validate import validate
        from titan_plugins.distributed.parallel_dims import ParallelDims

        validate(config, ParallelDims(dp_replicate=1, dp_shard=1, tp=1, pp=1, ep=1, etp=1, world_size=1))
        stage = "reference"
        theirs = reference_model(folder)
        with torch.no_grad():
            theirs(_batch()[0])  # transformers' own forward on the tiny folder
        stage = "load"
        from titan_plugins.hf import load_hf_model

        ours = load_hf_model("hf", folder, overrides=["data=synthetic", "data.vocab_size=256"])
        stage = "compare"
        from titan_hf.verify import GRAD_TOL, LOSS_TOL, compare

        result = compare(ours, theirs, ours.structure.renames(), *_batch())
    except Exception as exc:  # noqa: BLE001 - one line per type, never a traceback
        if stage == "build" and row["builds"] is None:
            row["builds"] = False
        if stage == "reference":
            return {**row, "status": "untested", "reason": f"transformers cannot run its tiny folder: {one_line(exc)}"}
        status = "refused" if isinstance(exc, ConfigError) else "error"
        return {**row, "status": status, "reason": f"{stage}: {one_line(exc)}"}
    (mine, ref), (name, _, _, rel) = result["loss"], result["worst"]
    diff = abs(mine - ref)
    row.update(loss=[mine, ref], diff=diff, grad=[name, rel])
    if diff <= EQUAL_LOSS and rel <= EQUAL_GRAD and diff == diff:
        return {**row, "status": "equal", "checks": _checks(ours, folder, work / "checks" / model_type)}
    stops = config.architecture not in TESTED and not (diff <= LOSS_TOL and rel <= GRAD_TOL)
    return {**row, "status": "differ", "verify_stops": stops,
            "reason": f"loss {mine:.6g} vs {ref:.6g}; worst gradient {name} ({rel:.1e})"}


def _checks(ours: torch.nn.Module, folder: Path, work: Path) -> dict[str, str]:
    """The export, LoRA and generation cells of an equal type (``titan_hf.matrix_checks``);
    a check that cannot even start is an ``error`` cell each, never the row's failure."""
    try:
        from titan_hf.matrix_checks import run_checks

        return run_checks(ours, folder, work)
    except Exception as exc:  # noqa: BLE001 - one line per cell (the module itself may not import)
        return dict.fromkeys(("export", "lora", "generation"), f"error: {one_line(exc)}")


def launch_jobs(work: str | Path, *, world: int, alone: dict[str, Path] | None = None,
                ranks: dict[str, Path] | None = None, timeout: float = 300) -> dict[str, list[float] | str]:
    """Train already composed jobs (``name -> config.yaml`` written by ``write_config``):
    ``alone`` on one rank (rank 0, world of one), ``ranks`` on ``world`` gloo ranks, in as
    few launches as it takes (``titan_hf.testing.train_configs_in_one_launch``). Returns
    ``name -> step losses``, or ``name -> "error: <one line>"`` for a job that failed
    inside a rank: unlike ``train_in_one_launch`` a failure does not stop the others, the
    jobs after it run in a fresh launch. A launch in which no job finishes for
    ``timeout`` seconds is stopped; the job it was on is charged with the timeout."""
    from titan_hf.testing import train_configs_in_one_launch

    alone, ranks = dict(alone or {}), dict(ranks or {})
    out: dict[str, list[float] | str] = {}
    launch = 0
    while alone or ranks:
        launch += 1
        losses, failed = train_configs_in_one_launch(Path(work) / f"launch{launch}", world=world, alone=alone,
                                                     ranks=ranks, timeout=timeout)
        out.update(losses)
        if failed:
            name, _, why = failed
            text = " ".join(why.split())
            out[name] = "error: " + (text if len(text) <= 240 else text[:237] + "...")
        alone = {n: c for n, c in alone.items() if n not in out}
        ranks = {n: c for n, c in ranks.items() if n not in out}
    return out
