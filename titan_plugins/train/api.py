"""Programmatic ``titan-run``: compose, validate, write the resolved config,
launch the ranks, wait, and read the result back from the run directory.

    from titan_plugins.train.api import run
    result = run(["model=tiny", "parallelism=fsdp2"], run_dir=tmp, extra_plugins=["tiny_plugin"])
    result.losses        # full-precision floats, from <run_dir>/metrics.jsonl

User errors raise ``titan_plugins.errors.ConfigError`` (one line) before any rank starts.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import signal
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig, OmegaConf

from titan_plugins.errors import ConfigError
from titan_plugins.spec import ModelSpec
from titan_plugins.train.run_files import RunResult, read_result, write_config, write_result

if TYPE_CHECKING:
    from titan_plugins.plugins import TitanPluginManager

__all__ = ["RunResult", "job_world_size", "prepare_job", "read_result", "run", "validate_job", "write_config"]

_DEGREES = ("dp_replicate", "dp_shard", "cp", "tp", "pp", "ep", "etp")


# ------------------------------------------------------------------ validation
def typed_job(job: DictConfig) -> DictConfig:
    """The resolved job merged into the schema (enums as Enum members, checked types)."""
    from titan_plugins.config.schema import JobConfig

    try:
        return OmegaConf.merge(OmegaConf.structured(JobConfig), job)
    except Exception as exc:
        from titan_plugins.config.hydra_glue import format_config_error

        raise ConfigError(format_config_error(exc)) from exc


def job_world_size(job: DictConfig) -> int | None:
    """WORLD_SIZE under torchrun/Slurm, else ``parallelism.world_size`` (may be None)."""
    if "WORLD_SIZE" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    ft = job.get("fault_tolerance")
    if job.parallelism.world_size is None and ft is not None and ft.enable and ft.group_size and \
            job.parallelism.dp_shard == -1:
        return int(ft.group_size)  # fault_tolerance=torchft: dp_shard=-1 fills one group
    return job.parallelism.world_size


def validate_job(spec: ModelSpec, job: DictConfig, pm: TitanPluginManager) -> Any:
    """Every check that can run before a rank starts; returns the ``ParallelDims``."""
    from titan_plugins.config.hydra_glue import model_config
    from titan_plugins.distributed.parallel_dims import ParallelDims
    from titan_plugins.distributed.pipeline import validate_pipeline

    par, training = job.parallelism, job.training
    dims = ParallelDims.from_config(par, job_world_size(job))
    caps = spec.capabilities
    for flag, enabled, key in (("fsdp", dims.dp_shard > 1, "dp_shard"), ("tp", dims.tp > 1, "tp"),
                               ("ep", dims.ep > 1, "ep"), ("pp", dims.pp > 1, "pp"), ("cp", dims.cp > 1, "cp")):
        if enabled and not getattr(caps, flag):
            raise ConfigError(f"model {spec.name!r} does not support parallelism.{key}={getattr(dims, key)}")
    if dims.pp > 1 and spec.pipeline is None:
        raise ConfigError(f"model {spec.name!r} has no pipeline split information (parallelism.pp={dims.pp})")
    from titan_plugins.train.prelaunch import check_job, check_ranges

    check_ranges(job)  # every numeric option's range, declared once in config/schema.py
    config = model_config(job.model, spec)
    check_job(job, config, pm.datasets())  # seq_len vs the model, the data source, model.hf, sinks
    from titan_plugins.distributed.context_parallel import check_context_parallel

    check_context_parallel(job, spec.name, config, dims)  # seq_len into 2*cp chunks, what is not done yet
    from titan_plugins.distributed.fault_tolerance import check_fault_tolerance

    check_fault_tolerance(job, dims)  # fault_tolerance=torchft: what a replica group can hold
    validate = spec.load("validate")
    if validate is not None:
        validate(config, dims)
    from titan_plugins.objectives.rollout import samples_from_the_policy

    check_decoding = spec.load("check_decoding")
    if check_decoding is not None and samples_from_the_policy(job):
        check_decoding(config)  # the rollouts decode with the KV cache: a model that cannot, before launch
    n_layers = None
    if dims.pp > 1:
        from titan_plugins.model.lifecycle import build_meta_model

        n_layers = len(getattr(build_meta_model(spec, job), spec.pipeline.layers_attr))
    validate_pipeline(par, int(training.local_batch_size), n_layers)
    if job.precision.compute_dtype is not None:
        from titan_plugins.model.lifecycle import build_meta_model

        build_meta_model(spec, job)  # raises if the model has no set_compute_dtype
    from titan_plugins.peft.config import lora_enabled  # no torch: the launcher stays light

    if lora_enabled(job):  # target patterns, float8, peft.init_from's folder: before any rank starts
        from titan_plugins.train.prelaunch_peft import check_lora

        check_lora(spec, job, config)
    from titan_plugins.data.loader import find_dataset

    find_dataset(job.data.name, pm.datasets())
    _check_vocab(config, job.data)
    from titan_plugins.data.special_tokens import check_attention_mask

    check_attention_mask(config, job.data)
    from titan_plugins.train.validation import check_validation

    check_validation(job)
    init_from = job.checkpoint.init_from
    if init_from and not (Path(init_from) / ".metadata").is_file():
        raise ConfigError(f"checkpoint.init_from={init_from}: no DCP checkpoint there (missing .metadata)")
    planning = job.get("plan") is not None and job.plan.enabled  # a plan runs nothing
    if job.model.get("hf") and not init_from and not planning and job.model.get("verified") is None:
        from titan_plugins.model.verify import verify_model

        job.model.verified = verify_model(spec, job, config, pm.datasets())  # the header's line (or None)
    return dims


def _check_vocab(model_config: Any, data: DictConfig) -> None:
    """Token ids must fit the model's embedding: a smaller ``vocab_size`` would crash
    every rank with an index error in its first forward."""
    model_vocab = getattr(model_config, "vocab_size", None)
    if not isinstance(model_vocab, int):
        return  # the model does not say; nothing to compare
    if data.name == "synthetic" and data.vocab_size:
        data_vocab, source = int(data.vocab_size), f"data.vocab_size={data.vocab_size}"
    else:
        from titan_plugins.data.tokenizer import build_tokenizer

        data_vocab = build_tokenizer(data).vocab_size
        where = f"data.tokenizer={data.tokenizer}" if data.tokenizer else "the shipped tokenizer"
        source = f"{where} ({data_vocab} ids)"
    if data_vocab > model_vocab:
        raise ConfigError(
            f"model.vocab_size={model_vocab} is smaller than {source}: token ids would index past "
            "the embedding (raise model.vocab_size or use a smaller tokenizer)"
        )


def prepare_job(
    overrides: Sequence[str], pm: TitanPluginManager, *, run_dir: str | os.PathLike | None = None
) -> tuple[ModelSpec, DictConfig, Any]:
    """Compose (Hydra compose API), resolve the model, validate. Returns
    ``(spec, job, parallel_dims)`` with ``job.run_dir`` set if given."""
    from titan_plugins.config.hydra_glue import compose

    cfg = compose(list(overrides), pm)
    return finish_job(cfg, pm, run_dir=run_dir)


_NOTED: set[str] = set()


def finish_job(cfg: DictConfig, pm: TitanPluginManager, *, run_dir: str | os.PathLike | None = None):
    from titan_plugins.config.hydra_glue import resolve_job

    spec, job = resolve_job(cfg, pm)
    from titan_plugins.data.special_tokens import hand_document_mask, hand_special_tokens

    note = hand_document_mask(spec, job, cfg.model)  # packed conversations: block-causal
    if note and note not in _NOTED:  # the job is prepared more than once per launch
        _NOTED.add(note)
        print(note, flush=True)
    hand_special_tokens(spec, job, cfg.model)  # eos_id from the tokenizer in use
    job = typed_job(job)
    if run_dir is not None:
        job.run_dir = str(Path(run_dir).resolve())
    if job.checkpoint.create_seed:  # one rank, no parallelism: the seed is parallelism-free
        for key in _DEGREES:
            job.parallelism[key] = 1
        job.parallelism.world_size = None
    dims = validate_job(spec, job, pm)
    return spec, job, dims


# ------------------------------------------------------------------------- run
def _module_root(name: str) -> str | None:
    spec = importlib.util.find_spec(name)
    if spec is None or spec.origin is None:
        return None
    root = Path(spec.origin).parent
    for _ in name.split(".")[1:]:
        root = root.parent
    if Path(spec.origin).name == "__init__.py":
        root = root.parent
    return str(root)


@contextlib.contextmanager
def _patched_env(env: dict[str, str]) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def rank_env(extra_plugins: Sequence[str], env: dict | None = None) -> dict[str, str]:
    """The environment additions the ranks need for ``extra_plugins`` to import."""
    out = {k: str(v) for k, v in (env or {}).items()}
    if extra_plugins:
        current = [m for m in os.environ.get("TITAN_PLUGINS_EXTRA", "").split(",") if m]
        out["TITAN_PLUGINS_EXTRA"] = ",".join(dict.fromkeys([*current, *extra_plugins]))
        roots = [r for r in (_module_root(m) for m in extra_plugins) if r]
        paths = [*roots, *[p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]]
        out["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    return out


def run(
    overrides: Sequence[str],
    *,
    run_dir: str | os.PathLike,
    extra_plugins: Sequence[str] = (),
    timeout: float | None = None,
    env: dict | None = None,
) -> RunResult:
    """Compose + validate in this process (``ConfigError`` before any rank starts),
    write ``<run_dir>/config.yaml``, run the ranks in a subprocess (killed with its
    ranks after ``timeout`` seconds), and return what the run wrote."""
    from titan_plugins.plugins import get_plugin_manager
    from titan_plugins.run_dir import child_env, owned

    run_dir = Path(run_dir).resolve()
    added = rank_env(extra_plugins, env)
    with _patched_env(added):
        pm = get_plugin_manager(strict=True)
        spec, job, dims = prepare_job(overrides, pm, run_dir=run_dir)
    with owned(run_dir):  # claimed before config.yaml is written; the launcher child shares it
        return _run_claimed(job, dims, run_dir, {**added, **child_env(run_dir)}, timeout, overrides)


def _start_worker(argv: list[str], env: dict[str, str]) -> Any:
    """The job's launcher in a session of its own: forked from the zygote
    (``train.zygote``), else ``python -m titan_plugins.train.worker``."""
    from titan_plugins.train import zygote

    warm = zygote.start_worker(argv, env)
    if warm is not None:
        return warm
    cmd = [sys.executable, "-m", "titan_plugins.train.worker", *argv]
    return subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )


def _run_claimed(job: DictConfig, dims: Any, run_dir: Path, added: dict[str, str], timeout: float | None,
                 overrides: Sequence[str]) -> RunResult:
    config_path = write_config(job, run_dir)
    from titan_plugins.failures import clear_error_file

    clear_error_file(run_dir)
    if job.plan.enabled:
        raise ConfigError("plan=true is not supported by titan_plugins.train.api.run; use titan-run")
    nproc = dims.world_size
    proc_env = {**os.environ, **added}
    proc = _start_worker([str(config_path), str(nproc)], proc_env)
    try:
        out, err = proc.communicate(timeout=timeout)
        code, error = proc.returncode, None
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        code, error = 124, f"timed out after {timeout} s"
    result = read_result(run_dir, code, error)
    if code != 0 and result.error is None:
        lines = [line for line in err.strip().splitlines() if line.strip()]
        result.error = lines[-1] if lines else f"exit code {code}"
    result.stdout, result.stderr = out, err
    with contextlib.suppress(OSError):  # result.json, as titan-run writes it
        write_result(run_dir, job="0", overrides=" ".join(overrides), returncode=code, error=result.error)
    return result
