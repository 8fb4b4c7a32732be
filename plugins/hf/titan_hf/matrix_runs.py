"""One matrix row: a ``model_type`` classified, built, and trained one step against
transformers (one rank, in process), and on parallel layouts through ``titan-run``.

Every failure is caught and kept as one line: ``refused`` is a ``ConfigError`` (the
plugin's own one-line refusal, before launch), ``error`` anything else (a crash),
``untested`` a type for which transformers itself cannot build or load a tiny folder.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from titan_plugins.errors import ConfigError

__all__ = ["EQUAL_GRAD", "EQUAL_LOSS", "LAYOUTS", "layout_runs", "one_line", "one_rank"]

#: one rank equals transformers: step-1 loss within EQUAL_LOSS (absolute, fp32) and every
#: parameter's gradient norm within EQUAL_GRAD (relative)
EQUAL_LOSS = 1e-5
EQUAL_GRAD = 1e-4
#: ``--layouts`` names -> (world size, titan-run overrides)
LAYOUTS: dict[str, tuple[int, list[str]]] = {
    "fsdp2": (2, ["parallelism=fsdp2"]),
    "fsdp2_tp2": (4, ["parallelism=fsdp2_tp2"]),
    "ep": (2, ["parallelism=fsdp2_ep2"]),
    "pp2": (2, ["parallelism=pp2"]),
}
STEPS = 2
COMMON = ["model=hf", "data=synthetic", "data.vocab_size=256", f"training.steps={STEPS}",
          "training.deterministic=true", "training.seq_len=16", "training.local_batch_size=4",
          "training.lr=1e-3", "training.warmup_steps=0", "metrics.tensorboard=false", "metrics.console=false",
          "model.verify=false"]  # the one-rank column compares against transformers already


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
    "reason", "loss", "diff", "grad", "verify_stops"}``."""
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
        return {**row, "status": "equal"}
    stops = config.architecture not in TESTED and not (diff <= LOSS_TOL and rel <= GRAD_TOL)
    return {**row, "status": "differ", "verify_stops": stops,
            "reason": f"loss {mine:.6g} vs {ref:.6g}; worst gradient {name} ({rel:.1e})"}


def layout_runs(model_type: str, folder: Path, layouts: list[str], work: Path,
                timeout: float = 600) -> dict[str, str]:
    """``layout -> cell``: each layout's step losses through ``titan-run`` (gloo ranks)
    against the same folder on one rank, same global batch; ``equal <diff>``,
    ``differ <diff>``, ``refused: <line>`` (``validate``), ``error: <line>``."""
    from titan_hf.testing import train_in_one_launch
    from titan_plugins.compare.runner import match_global_batch
    from titan_plugins.plugins import get_plugin_manager
    from titan_plugins.train.api import prepare_job

    pm = get_plugin_manager(strict=True)
    base = [*COMMON, f"model.hf={folder}", "parallelism=single"]
    cells: dict[str, str] = {}
    jobs: dict[int, dict[str, list[str]]] = {}
    for layout in layouts:
        world, overrides = LAYOUTS[layout]
        try:
            argv = match_global_batch(base, [*base[:-1], *overrides])[0]
            prepare_job(argv, pm, run_dir=work / "check" / layout)
        except Exception as exc:  # noqa: BLE001
            cells[layout] = f"{'refused' if isinstance(exc, ConfigError) else 'error'}: {one_line(exc)}"
            continue
        jobs.setdefault(world, {})[layout] = argv
    if not jobs:
        return cells
    baseline: list[float] | None = None
    for world, ranks in sorted(jobs.items()):
        pending = dict(ranks)
        while pending:
            alone = {"single": base} if baseline is None else {}
            try:
                out = train_in_one_launch(work / f"world{world}", world=world, alone=alone, ranks=pending,
                                          timeout=timeout)
            except Exception as exc:  # noqa: BLE001 - "<job> (rank r): <error>": drop that job, rerun the rest
                text = one_line(exc)
                failed = next((name for name in [*alone, *pending] if text.startswith(f"RuntimeError: {name} ")),
                              None)
                if failed is None or failed == "single":
                    for name in pending:
                        cells[name] = f"error: {text}"
                    return cells
                line = text.split(": ", 2)[-1]  # "RuntimeError: <job> (rank r): <error>"
                cells[failed] = (f"refused inside a rank: {line}" if line.startswith("ConfigError: ")
                                 else f"error: {line}")
                pending.pop(failed)
                continue
            if baseline is None:
                baseline = out["single"][0]
            for name in pending:
                got = out[name][0]
                diff = max((abs(a - b) for a, b in zip(baseline, got, strict=True)), default=float("nan"))
                ok = len(got) == len(baseline) == STEPS and diff <= EQUAL_LOSS
                cells[name] = f"{'equal' if ok else 'differ'} {diff:.1e}"
            pending = {}
    return cells
