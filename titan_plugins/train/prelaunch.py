"""Checks of a job that need no rank: values out of range and inputs that cannot be
read end with one line naming the key and the value, before any rank starts
(``titan_plugins.train.api.validate_job`` calls ``check_ranges`` and ``check_job``).

- Ranges: every numeric option with a meaningful range declares it once, in the
  schema (``titan_plugins.config.schema.ranged``: ``interval: int = ranged(50, "[1, inf)")``);
  ``check_ranges`` walks the schema's dataclasses and checks them all. Parallel
  degrees are ``ParallelDims``' (``dp_shard=-1`` is no interval).
- Data: the chosen dataset's ``DatasetSpec.check`` (a ``"module:function"`` reference,
  ``check(data_config)`` raising ``ConfigError``) runs here. A data source declares
  its own check when it registers (``data/builtin.py`` for text, jsonl, parquet,
  hf and mix); a source without one (builtin, synthetic) is checked by its builder in
  the ranks.
- ``model.hf``: every ``*.safetensors`` header is read (length, JSON, data offsets
  within the file), so a truncated or foreign file is one line naming it.
- Output folders the run will write (``checkpoint.export_hf``'s ``<run_dir>/hf``, a
  seed checkpoint) follow ``titan_plugins.export.out_dir``: nothing of the user's is replaced.
- Sinks: an enabled MLflow sink's tracking URI must be one the installed client serves.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from titan_plugins.errors import ConfigError

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from titan_plugins.spec import DatasetSpec

__all__ = ["check_hf_weights", "check_job", "check_mlflow_uri", "check_ranges", "declared_ranges"]

_MAX_HEADER = 100_000_000  # safetensors' own limit on the JSON header


# ------------------------------------------------------------------ ranges
def declared_ranges() -> dict[str, str]:
    """``{"checkpoint.interval": "[1, inf)", ...}``: every range the schema declares."""
    from titan_plugins.config.schema import JobConfig

    out: dict[str, str] = {}

    def walk(prefix: str, node: Any) -> None:
        for f in dataclasses.fields(node):
            value = getattr(node, f.name, None)
            if dataclasses.is_dataclass(value):
                walk(f"{prefix}{f.name}.", value)
            elif "range" in f.metadata:
                out[f"{prefix}{f.name}"] = f.metadata["range"]

    walk("", JobConfig())
    return out


def _interval(text: str) -> tuple[float, float, bool, bool]:
    lo, hi = (float(v) for v in text[1:-1].split(","))
    return lo, hi, text[0] == "[", text[-1] == "]"


def _rule(text: str) -> str:
    lo, hi, lo_in, _ = _interval(text)
    if math.isinf(hi):
        if lo == 0 and not lo_in:
            return "must be positive"
        return f"must be at least {lo:g}" if lo_in else f"must be above {lo:g}"
    return f"must be in {text}"


def in_range(value: float, text: str) -> bool:
    lo, hi, lo_in, hi_in = _interval(text)
    return (lo <= value if lo_in else lo < value) and (value <= hi if hi_in else value < hi)


def check_ranges(job: DictConfig) -> None:
    """Every option with a declared range (``schema.ranged``) holds a value inside it."""
    from omegaconf import OmegaConf

    for key, text in declared_ranges().items():
        value = OmegaConf.select(job, key, default=None)
        if value is None or isinstance(value, bool):
            continue
        if not in_range(float(value), text):
            raise ConfigError(f"{key}={value} {_rule(text)}")


# ------------------------------------------------------------------ the job
def check_job(job: DictConfig, model_config: Any, datasets: Mapping[str, DatasetSpec] | None = None) -> None:
    """Ranges, ``training.seq_len`` within the model's ``max_seq_len`` (where it has
    one), the data source readable (``datasets``: the registered ones, default the
    core's), ``model.hf``'s weight files, the output folders, the sinks."""
    check_ranges(job)
    training = job.training
    max_len = getattr(model_config, "max_seq_len", None)
    if isinstance(max_len, int) and int(training.seq_len) > max_len:
        raise ConfigError(
            f"training.seq_len={training.seq_len} is above the model's max_seq_len={max_len} "
            "(lower training.seq_len or raise model.max_seq_len)"
        )
    check_data(job.data, datasets)
    from titan_plugins.objectives.base import Objective
    from titan_plugins.objectives.registry import build_objective

    objective = build_objective(job.get("objective"))
    objective.check(job)  # its own limits (dpo: pair data, even batch, no PP)
    rollout = job.get("rollout")
    if rollout is not None and rollout.name != "native" and type(objective).rollout is Objective.rollout:
        raise ConfigError(f"rollout={rollout.name}: objective.name={objective.name} samples nothing "
                          "(rollout= chooses where an online objective's completions come from: objective=grpo)")
    hf = job.model.get("hf") if hasattr(job.model, "get") else None
    if hf:
        check_hf_weights(hf)
    _check_outputs(job)
    from titan_plugins.train.profiling import check_profiling
    from titan_plugins.train.sinks import check_sinks

    check_sinks(job)  # an enabled MLflow/W&B sink needs its package
    check_mlflow_uri(job)
    check_profiling(job)
    from titan_plugins.train.preemption import check_on_signal

    check_on_signal(job)  # checkpoint.on_signal needs checkpoints
    from titan_plugins.distributed.float8 import check_float8

    check_float8(job)  # no CUDA / SM < 8.9 / no torchao: one line before launch


def check_data(data: Any, datasets: Mapping[str, DatasetSpec] | None = None) -> None:
    """The chosen dataset's own ``check`` (``DatasetSpec.check``), if it declares one.
    An unknown ``data.name`` is left to ``find_dataset`` (one line with a suggestion)."""
    if datasets is None:
        from titan_plugins.data.builtin import DATASETS

        datasets = {spec.name: spec for spec in DATASETS}
    spec = datasets.get(data.name)
    if spec is None or spec.check is None:
        return
    from titan_plugins.spec import resolve

    resolve(spec.check)(data)


# ------------------------------------------------------------------ model.hf
def check_hf_weights(folder: str | os.PathLike, key: str = "model.hf") -> None:
    """Each ``*.safetensors`` of ``folder`` (those the index names, else all) has a
    readable header whose tensors lie inside the file: one line naming a file that is
    missing, truncated or not safetensors."""
    folder = Path(folder).expanduser()
    if not folder.is_dir():
        return  # read_hf_config says what is wrong with the folder itself
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ConfigError(f"{key}={folder}: {index.name} is not a safetensors index ({exc})") from None
        for name in names:
            if not (folder / name).is_file():
                raise ConfigError(f"{key}={folder}: {name} (named in {index.name}) is missing")
    else:
        names = sorted(p.name for p in folder.glob("*.safetensors"))
    for name in names:
        problem = _safetensors_problem(folder / name)
        if problem:
            raise ConfigError(f"{key}={folder}: {name} {problem}")


def _safetensors_problem(path: Path) -> str | None:
    """Why ``path`` is not a complete safetensors file, or None (reads its header only)."""
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return f"is truncated ({size} bytes, no header)"
        n = int.from_bytes(head, "little")
        if n > _MAX_HEADER or 8 + n > size:
            return f"is truncated or not safetensors (header of {n} bytes, file of {size})"
        try:
            header = json.loads(f.read(n).decode("utf-8"))
        except (UnicodeDecodeError, ValueError):
            return "is not safetensors (its header is not JSON)"
    if not isinstance(header, dict):
        return "is not safetensors (its header is not a JSON object)"
    data = size - 8 - n
    for name, info in header.items():
        if name == "__metadata__":
            continue
        offsets = info.get("data_offsets") if isinstance(info, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)
                and 0 <= offsets[0] <= offsets[1]):
            return f"is not safetensors (tensor {name!r} has no valid data_offsets)"
        if offsets[1] > data:
            return f"is truncated (tensor {name!r} ends at byte {offsets[1]} of {data} data bytes)"
    return None


# ------------------------------------------------------------------ outputs
def _check_outputs(job: DictConfig) -> None:
    """What the run will replace at its end or start, claimed before launch (the run
    directory is known only once set: ``job.run_dir`` is ``.`` until then)."""
    run_dir = str(job.get("run_dir") or ".")
    if run_dir == ".":
        return
    ckpt = job.checkpoint
    if ckpt.get("export_hf"):
        from titan_plugins.export.out_dir import claim_out_dir
        from titan_plugins.peft.export import export_hf_folders  # a LoRA run: merged + adapter

        for folder, kind in export_hf_folders(job, Path(run_dir) / "hf"):
            claim_out_dir(folder, kind, overwrite=True, key="checkpoint.export_hf=true: folder",
                          protect={"the run directory": run_dir})
    if ckpt.get("create_seed"):
        folder = Path(ckpt.folder)
        seed = (folder if folder.is_absolute() else Path(run_dir) / folder) / "seed"
        if seed.exists() and not (seed / ".metadata").is_file():
            raise ConfigError(f"checkpoint.create_seed=true: {seed} exists and is not a DCP checkpoint; "
                              "not replaced (move it away or set checkpoint.folder)")


# ------------------------------------------------------------------ sinks
def check_mlflow_uri(job: DictConfig) -> None:
    """An enabled MLflow sink's tracking URI (``metrics.mlflow.tracking_uri``, else
    ``$MLFLOW_TRACKING_URI``) has a store in the installed client: mlflow-skinny (the
    ``mlflow`` extra) serves files and servers (http), not databases."""
    cfg = job.metrics.get("mlflow")
    if cfg is None or not cfg.enabled:
        return
    uri = cfg.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
    if not uri:
        return  # the default: file:<run_dir>/mlruns
    key = "metrics.mlflow.tracking_uri" if cfg.tracking_uri else "MLFLOW_TRACKING_URI"
    registry = _mlflow_registry()
    if registry is None:
        return  # not installed (check_sinks said so) or a client whose registry we cannot read
    try:
        registry.get_store_builder(uri)  # the lookup MLflow itself does; builds nothing
    except Exception:
        known = getattr(registry, "_registry", None)
        shown = ", ".join(sorted(s or "a path" for s in known)) if isinstance(known, dict) else "?"
        raise ConfigError(
            f"{key}={uri}: the installed MLflow client cannot store runs there (it serves: {shown}); "
            "a database URI needs the full mlflow package, or run `mlflow server` and give its http:// URI"
        ) from None


def _mlflow_registry() -> Any:
    import importlib.util

    if importlib.util.find_spec("mlflow") is None:
        return None
    try:
        from mlflow.tracking._tracking_service.utils import _tracking_store_registry
    except ImportError:
        return None
    return _tracking_store_registry if hasattr(_tracking_store_registry, "get_store_builder") else None
