"""The plugin contract: every hook a titan-plugins plugin may implement.

A plugin is a module (found through the ``titan_plugins`` entry-point group)
with top-level functions marked ``@titan_plugins.hookimpl`` whose names are
the hook names below.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from titan_plugins.distributed.parallel_dims import ParallelDims

PROJECT_NAME = "titan_plugins"
hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


@hookspec
def titan_register_models(register: Any) -> None:
    """Register model specs.

    :param register: call ``register(spec)`` once per ``titan_plugins.ModelSpec``.
        Two plugins registering one name is a load error naming both distributions.
    """


@hookspec
def titan_register_datasets(register: Any) -> None:
    """Register datasets usable as ``data.name=<name>``.

    :param register: call ``register(spec)`` once per ``titan_plugins.DatasetSpec``.
    """


@hookspec
def titan_config_searchpath() -> str | list[str] | None:
    """Return Hydra search-path entries (``"pkg://your_package.conf"``) holding the
    config groups this plugin contributes (``model/<name>.yaml``, presets, ...).

    The core adds them before composition; ``titan-run --info searchpath`` names
    the distribution that provided each entry.
    """


@hookspec(firstresult=True)
def titan_after_parallelize(model: Any, parallel_dims: ParallelDims, job_config: DictConfig) -> Any:
    """Called once per model part after the model's parallelize hook, before
    ``to_empty`` and ``init_weights``. ``firstresult``: the first non-None result
    is the model part the trainer uses; the core's own implementation returns
    ``model`` unchanged and runs last.

    Implement it with ``@hookimpl(wrapper=True)`` to wrap the result (a float8
    or compile plugin: ``model = yield; return convert(model)``).

    :param model: the parallelized ``nn.Module`` (one pipeline stage under PP).
    :param parallel_dims: the run's ``ParallelDims`` (meshes and degrees).
    :param job_config: the resolved job config (an OmegaConf ``DictConfig``).
    :return: the module to train.
    """


@hookspec
def titan_on_train_start(job_config: DictConfig, run_dir: str, rank: int) -> None:
    """Called on every rank before the first step.

    :param job_config: the resolved job config.
    :param run_dir: the job's output directory.
    :param rank: this process's global rank.
    """


@hookspec
def titan_on_step_end(step: int, metrics: dict[str, float], job_config: DictConfig, rank: int) -> None:
    """Called on every rank after each optimizer step; metric sinks (W&B, MLflow,
    CSV) usually act only where ``rank == 0``.

    :param step: the step just finished, counting from 1.
    :param metrics: ``loss``, ``grad_norm``, ``lr``, ``tokens_per_s``, ``tflops``,
        ``mfu``, ``memory_gib`` and anything the trainer adds; plain floats.
    :param job_config: the resolved job config.
    :param rank: this process's global rank.
    """


@hookspec
def titan_on_validation_end(step: int, metrics: dict[str, float], job_config: DictConfig, rank: int) -> None:
    """Called on every rank after each validation (``validation.enabled``), with the
    held-out loss of the model as it is after ``step``; sinks act where ``rank == 0``.

    :param step: the training step the model has just finished.
    :param metrics: ``loss`` (mean cross-entropy per held-out label token),
        ``perplexity`` (``exp(loss)``) and ``tokens`` (label tokens scored); plain floats.
    :param job_config: the resolved job config.
    :param rank: this process's global rank.
    """


@hookspec
def titan_on_train_end(step: int, metrics: dict[str, float], job_config: DictConfig, rank: int) -> None:
    """Called on every rank after the last step (also after a resumed run that
    had nothing left to do).

    :param step: the last step run.
    :param metrics: the last step's metrics (empty if no step ran).
    :param job_config: the resolved job config.
    :param rank: this process's global rank.
    """


@hookspec
def titan_on_train_error(step: int, error: str, metrics: dict[str, float], job_config: DictConfig, rank: int) -> None:
    """Called on a rank whose training loop raised, before the error ends the job, so
    that sinks can close what they opened as failed (an MLflow run ``FAILED``, a W&B
    run finished with exit code 1). Not called for a rank killed by a signal.

    :param step: the last step finished (0 if none).
    :param error: the exception, as ``"TypeName: message"``.
    :param metrics: the last finished step's metrics (empty if none).
    :param job_config: the resolved job config.
    :param rank: this process's global rank.
    """

