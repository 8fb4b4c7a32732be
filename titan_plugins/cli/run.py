"""``titan-run``: compose with Hydra, validate, write the resolved config, start the ranks.

    titan-run model=NAME [parallelism=P] [precision=Q] [key=value ...]
    titan-run -m model=a,b parallelism=x,y precision=p,q     # a sweep + summary table
    titan-run --help | --hydra-help | --info searchpath | --cfg job
    titan-run --list [--all] [--json]                         # installed plugins, their API ranges
    titan-run ... --json                                      # with plan=true: JSON output

Every user error ends as one ``error: ...`` line with exit code 2, before any
rank starts. Under ``torchrun``, or as a task of an ``srun`` step of several tasks,
each process trains as its own rank instead of spawning ranks
(``titan_plugins.distributed.external``):

    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d \\
        --rdzv-endpoint HOST:29500 -m titan_plugins.cli.run model=qwen3 parallelism=fsdp16
    srun -N 2 --ntasks-per-node 8 --kill-on-bad-exit=1 titan-run model=qwen3 parallelism=fsdp16

The run directory is ``$TITAN_RUN_DIR``, else ``hydra.run.dir=...`` if given, else
``outputs/slurm-<job>.<step>`` (one per job step) or
``outputs/torchrun-<run id>-<master addr>-<port>``; it must be shared between the nodes.
Inside a Slurm allocation but not in such a step (an ``sbatch`` script without ``srun``,
``salloc``) titan-run starts its own ranks, as on a workstation.

With hydra-submitit-launcher: ``titan-run -m hydra/launcher=submitit_slurm
hydra.launcher.tasks_per_node=2 ...`` runs each job's Slurm tasks as its ranks; with one
task per job, that task spawns the local ranks itself. The sweep directory is claimed
once, by the launching process; every job and rank uses it.
"""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from titan_plugins.errors import ConfigError, TitanError

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from titan_plugins.distributed.parallel_dims import ParallelDims
    from titan_plugins.plugins import TitanPluginManager
    from titan_plugins.spec import ModelSpec

_HYDRA_ONLY = ("--cfg", "-c", "--info", "-i", "--shell-completion", "-sc", "--hydra-help", "--resolve", "-p",
               "--package")
_MULTIRUN = ("-m", "--multirun")


def _usage(pm: TitanPluginManager) -> str:
    try:
        from titan_plugins.cli.help import format_help  # type: ignore[import-not-found]

        return format_help(pm)
    except ImportError:
        pass
    models = ", ".join(sorted(pm.models())) or "none installed"
    return (
        "usage: titan-run model=NAME [parallelism=P] [precision=Q] [group.key=value ...]\n"
        "       titan-run -m model=a,b parallelism=x,y precision=p,q   (sweep)\n"
        "       titan-run --hydra-help | --info searchpath | --cfg job\n\n"
        f"models: {models}\n"
    )


def _user_overrides(args: list[str]) -> list[str]:
    """Positional overrides without the hydra.* ones (which the compose API does not need)."""
    out, skip = [], False
    for a in args:
        if skip:
            skip = False
            continue
        if a in ("--config-dir", "-cd", "--config-name", "-cn", "--config-path", "-cp", "--info", "-i",
                 "--cfg", "-c", "--package", "-p", "--experimental-rerun"):
            skip = True
            continue
        if a.startswith("-"):
            continue
        key = a.lstrip("+~")
        if key.startswith(("hydra.", "hydra/")) or key.startswith("hydra="):
            continue
        out.append(a)
    return out


def _sweep_combinations(overrides: list[str]) -> list[list[str]]:
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(overrides)
    batches = BasicSweeper.split_arguments(parsed, max_batch_size=None)
    return [list(combo) for batch in batches for combo in batch]


def _slurm_to_torchrun_env() -> None:
    """A task of an ``srun`` step of several tasks is one rank (torchrun's variables from
    Slurm's); anywhere else in a Slurm job titan-run starts its own ranks."""
    from titan_plugins.distributed import slurm

    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:
        env.setdefault("TITAN_LAUNCHED_BY", "torchrun")
        return
    if slurm.where(env) == "step":
        env.update(slurm.rank_env(env))
        env["TITAN_LAUNCHED_BY"] = "slurm"


def _run_plan(spec: ModelSpec, job: DictConfig, pm: TitanPluginManager) -> int:
    try:
        from titan_plugins.plan import run_plan  # type: ignore[import-not-found]
    except ImportError:
        raise ConfigError("plan mode is not available") from None
    result = run_plan(spec, job, pm)
    return int(result) if isinstance(result, int) else 0


def _launch_job(spec: ModelSpec, job: DictConfig, dims: ParallelDims, pm: TitanPluginManager, run_dir: Path) -> int:
    from titan_plugins.distributed.launcher import launch
    from titan_plugins.failures import ERROR_FILE, clear_error_file
    from titan_plugins.train.api import write_config
    from titan_plugins.train.worker import entry, forwarded_signals, rank_preload

    config_path = write_config(job, run_dir)
    if job.plan.enabled:
        return _run_plan(spec, job, pm)
    clear_error_file(run_dir)
    if job.fault_tolerance.enable:  # replica groups under a torchft lighthouse
        from titan_plugins.distributed.ft_supervisor import launch_replicas
        from titan_plugins.train import zygote

        # the groups (and a restarted group) fork from one warm process: ~7 s of CPU each otherwise
        return launch_replicas(job, run_dir, dims.world_size, write_config,
                               start_worker=functools.partial(zygote.popen_module, zygote.WORKER))
    return launch(config_path, dims.world_size, entry, error_file=run_dir / ERROR_FILE, preload=rank_preload(spec),
                  forward=forwarded_signals(job))


def _torchrun_run_dir() -> str:
    """The same directory on every rank of one job, another one for any other live job:
    the Slurm job and step (``srun``), else torchrun's run id (``none`` unless
    ``--rdzv-id`` is given) with the master's address and port (which no two live jobs
    share)."""
    from titan_plugins.distributed.slurm import step_name

    env = os.environ
    if env.get("TITAN_LAUNCHED_BY") == "slurm":
        return f"outputs/{step_name(env)}"
    run_id = env.get("TORCHELASTIC_RUN_ID") or "job"
    master = f"{env.get('MASTER_ADDR', 'localhost')}-{env.get('MASTER_PORT', '0')}"
    return f"outputs/torchrun-{run_id}-{master}"


def _torchrun_main(argv: list[str], overrides: list[str], pm: TitanPluginManager) -> int:
    """Train as this process's rank (torchrun / srun started us)."""
    from titan_plugins.distributed.external import run_external_rank
    from titan_plugins.train.api import prepare_job

    given = _given_dir(argv, "hydra.run.dir")
    key = "TITAN_RUN_DIR" if os.environ.get("TITAN_RUN_DIR") else "hydra.run.dir"
    run_dir = Path(os.environ.get("TITAN_RUN_DIR") or given or _torchrun_run_dir()).resolve()
    spec, job, dims = prepare_job(overrides, pm, run_dir=run_dir)
    plan = (lambda: _run_plan(spec, job, pm)) if job.plan.enabled else None
    return run_external_rank(job, run_dir, key=key, overrides=" ".join(overrides), job_name="0", plan=plan)


def main(argv: list[str] | None = None) -> int:
    from titan_plugins.run_dir import forget_claims

    argv = list(sys.argv[1:] if argv is None else argv)
    forget_claims()  # this titan-run claims its own directories
    try:
        return _main(argv)
    except TitanError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return exc.exit_code
    except KeyboardInterrupt:
        from titan_plugins.failures import INTERRUPTED

        print(f"error: {INTERRUPTED}", file=sys.stderr, flush=True)
        return 130
    finally:
        forget_claims()  # the run directories this titan-run held are free again


def _main(argv: list[str]) -> int:
    from titan_plugins.config.hydra_glue import normalize_overrides
    from titan_plugins.plugins import get_plugin_manager

    if "--json" in argv and "--list" not in argv:
        argv = [a for a in argv if a != "--json"] + ["plan.json=true"]
    if "--help" in argv or "-h" in argv:
        print(_usage(get_plugin_manager()), end="")
        return 0
    if "--list" in argv:  # what `titan-plugins list` prints: lenient, broken plugins shown
        import argparse

        from titan_plugins.cli.plugins_cmd import run_list

        flags = argparse.Namespace(json="--json" in argv, all="--all" in argv)
        return run_list(flags, get_plugin_manager())
    argv = normalize_overrides(argv)
    pm = get_plugin_manager(strict=True)
    _slurm_to_torchrun_env()
    overrides = _user_overrides(argv)
    multirun = any(a in _MULTIRUN for a in argv)
    hydra_only = any(a in _HYDRA_ONLY for a in argv)
    if not multirun and _flag_value(argv, ("--cfg", "-c")) == "job":
        return _print_job(overrides, pm, _flag_value(argv, ("--package", "-p")))

    if not hydra_only:
        from titan_plugins.train.api import prepare_job

        if "RANK" in os.environ and "WORLD_SIZE" in os.environ and not multirun:
            return _torchrun_main(argv, overrides, pm)
        combos = _sweep_combinations(overrides) if multirun else [overrides]
        for combo in combos:
            try:
                prepare_job(combo, pm)
            except TitanError as exc:
                where = f" (job {' '.join(combo)})" if multirun and len(combos) > 1 else ""
                raise type(exc)(f"{exc}{where}") from None
        _check_run_dirs(argv, multirun)
    else:
        from titan_plugins.cli.help import info_argv

        argv = info_argv(argv, overrides, pm)  # --info searchpath needs no model=
    return _run_with_hydra(argv, pm, multirun)


def _flag_value(argv: list[str], names: tuple[str, ...]) -> str | None:
    """The value after the last of ``names`` in ``argv`` (``--cfg job`` -> ``job``)."""
    value = None
    for index, arg in enumerate(argv[:-1]):
        if arg in names:
            value = argv[index + 1]
    return value


def _print_job(overrides: list[str], pm: TitanPluginManager, package: str | None) -> int:
    """``--cfg job``: the job as the ranks would read it, the model node filled from its
    flavor (Hydra alone shows the schema's ``???`` there). A missing model or a bad
    override is one line, as for a run."""
    from omegaconf import OmegaConf

    from titan_plugins.config.hydra_glue import compose, resolve_job

    _, job = resolve_job(compose(overrides, pm), pm)
    node = job if package in (None, "", "_global_") else OmegaConf.select(job, package)
    if node is None:
        raise ConfigError(f"--package {package}: no such node in the job config")
    print(OmegaConf.to_yaml(node) if OmegaConf.is_config(node) else f"{node}\n", end="")
    return 0


def _given_dir(argv: list[str], key: str) -> str | None:
    given = [a.split("=", 1)[1] for a in argv if a.lstrip("+").startswith(f"{key}=")]
    return given[-1] if given else None


def _check_run_dirs(argv: list[str], multirun: bool) -> None:
    """Claim the run (or sweep) directory given on the command line before Hydra writes
    anything into it (``.hydra/``, the job log, ``config.yaml``): a live job's directory
    is one line and stays untouched. A default directory is claimed when Hydra resolves
    it (``titan_claim``)."""
    from titan_plugins.run_dir import check_writable, take

    key = "hydra.sweep.dir" if multirun else "hydra.run.dir"
    given = _given_dir(argv, key)
    if given:
        take(given, key)
        check_writable(given, key)
    else:  # the default: a new directory claimed under outputs/ (multirun/)
        check_writable("multirun" if multirun else "outputs", key)


def _run_with_hydra(argv: list[str], pm: TitanPluginManager, multirun: bool) -> int:
    from hydra import version
    from hydra._internal.utils import _run_hydra, get_args_parser
    from hydra.core.hydra_config import HydraConfig

    from titan_plugins.config.hydra_glue import register_configs
    from titan_plugins.train.api import finish_job
    from titan_plugins.train.sweep import FAILED_JOBS, SWEEP, print_summary, write_result

    version.setbase("1.3")
    register_configs(pm)
    codes: list[int] = []

    def task(cfg: Any) -> int:
        hc = HydraConfig.get()
        run_dir = Path(hc.runtime.output_dir)
        job_name = str(hc.job.num) if multirun else "0"
        overrides = " ".join(hc.overrides.task)
        error = None
        try:
            spec, job, dims = finish_job(cfg, pm, run_dir=run_dir)
            _slurm_to_torchrun_env()  # a submitit job: this Slurm task is one rank
            if "RANK" in os.environ and "WORLD_SIZE" in os.environ and not job.plan.enabled:
                from titan_plugins.distributed.external import run_external_rank

                # rank 0 claims the job's directory and writes result.json
                code = run_external_rank(job, run_dir, key="hydra.sweep.dir", overrides=overrides,
                                         job_name=job_name)
                codes.append(code)
                return code
            else:
                code = _launch_job(spec, job, dims, pm, run_dir)
        except TitanError as exc:
            print(f"error: {exc}", file=sys.stderr, flush=True)
            code, error = exc.exit_code, str(exc)
        except Exception as exc:  # a crash of the launcher itself: report, keep the sweep going
            print(f"error: job {job_name} failed: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
            code, error = 1, f"{type(exc).__name__}: {exc}"
        try:
            write_result(run_dir, job=job_name, overrides=overrides, returncode=code, error=error)
        except OSError:  # a full disk: the job's one error line is already printed
            pass
        codes.append(code)
        return code

    if multirun:
        argv = [*argv, "+hydra.callbacks.titan_summary._target_=titan_plugins.train.sweep.SummaryCallback"]
    if multirun and any("submitit" in a for a in argv if a.startswith("hydra/launcher")):
        # srun inside each job (submitit's batch script) stops the job's other tasks when
        # one fails (srun reads this variable like --kill-on-bad-exit=1)
        os.environ.setdefault("SLURM_KILL_BAD_EXIT", "1")
    parser = get_args_parser()
    args = parser.parse_args(argv)
    FAILED_JOBS.clear()
    SWEEP.clear()
    try:
        _run_hydra(
            args=args,
            args_parser=parser,
            task_function=task,
            config_path="pkg://titan_plugins.conf",
            config_name="train",
        )
    except SystemExit:  # Hydra reported a launcher failure (submitit: a job Slurm killed)
        if not multirun or "dir" not in SWEEP or SWEEP.get("printed"):
            raise
        print_summary(SWEEP["dir"])
        return 1
    if multirun:
        return 1 if FAILED_JOBS or any(codes) else 0
    return codes[0] if codes else 0


if __name__ == "__main__":
    sys.exit(main())
