"""One ``test_hook_<name>`` per hook (the meta-test in test_hooks_documented.py
checks that none is missing). Each calls the hook in-process through a manager
that the test owns; the trainer's own calls are tested with the runtime."""

from __future__ import annotations

import types
from typing import Any

import pytest
import toy_plugin

from titan_plugins import DatasetSpec, hookimpl
from titan_plugins.config import hydra_glue
from titan_plugins.plugins import get_plugin_manager


@pytest.fixture
def pm(monkeypatch: pytest.MonkeyPatch) -> Any:
    for var in ("TITAN_PLUGINS_EXTRA", "TITAN_TRACE_PLUGINS"):
        monkeypatch.delenv(var, raising=False)
    return get_plugin_manager(autoload=False)


def plugin(name: str, **hooks: Any) -> types.ModuleType:
    mod = types.ModuleType(name)
    for hook_name, function in hooks.items():
        setattr(mod, hook_name, function)
    return mod


def test_hook_titan_register_models(pm: Any) -> None:
    @hookimpl
    def titan_register_models(register: Any) -> None:
        register(toy_plugin.spec("one"))
        register(toy_plugin.spec("two", default_flavor="wide"))

    pm.add_plugin(plugin("p_models", titan_register_models=titan_register_models), dist="d", version="1")
    assert set(pm.models()) == {"one", "two"}
    assert pm.get_model("two").default_flavor == "wide"
    assert pm.infos["p_models"].models == ["one", "two"]


def test_hook_titan_register_datasets(pm: Any) -> None:
    @hookimpl
    def titan_register_datasets(register: Any) -> None:
        register(DatasetSpec(name="corpus", build="somewhere:build"))

    pm.add_plugin(plugin("p_data", titan_register_datasets=titan_register_datasets))
    assert pm.datasets()["corpus"].build == "somewhere:build"
    assert "builtin" in pm.datasets()  # the core's own datasets come through the same hook


def test_hook_titan_config_searchpath(pm: Any, tmp_path: Any) -> None:
    (tmp_path / "precision").mkdir()
    (tmp_path / "precision" / "fp16_mixed.yaml").write_text(
        "name: fp16_mixed\nparam_dtype: float16\nreduce_dtype: float32\n")

    @hookimpl
    def titan_config_searchpath() -> list[str]:
        return [f"file://{tmp_path}"]

    pm.add_plugin(toy_plugin)
    pm.add_plugin(plugin("p_conf", titan_config_searchpath=titan_config_searchpath), dist="titan-p", version="2")
    assert pm.searchpath() == [("titan-p (p_conf)", f"file://{tmp_path}")]
    cfg = hydra_glue.compose(["model=toy", "precision=fp16_mixed"], pm)
    assert cfg.precision.param_dtype.value == "float16"


def test_hook_titan_after_parallelize(pm: Any) -> None:
    # Without plugins the core's trylast implementation hands the model back.
    model = object()
    assert pm.hook.titan_after_parallelize(model=model, parallel_dims=None, job_config=None) is model

    @hookimpl(wrapper=True)
    def titan_after_parallelize(model: Any, parallel_dims: Any, job_config: Any) -> Any:
        inner = yield
        return ("wrapped", inner)

    pm.add_plugin(plugin("p_wrap", titan_after_parallelize=titan_after_parallelize))
    assert pm.hook.titan_after_parallelize(model=model, parallel_dims=None, job_config=None) == ("wrapped", model)

    @hookimpl
    def replace(model: Any, parallel_dims: Any, job_config: Any) -> Any:
        return "replacement"

    pm.add_plugin(plugin("p_replace", titan_after_parallelize=replace))
    assert pm.hook.titan_after_parallelize(model=model, parallel_dims=None, job_config=None) == (
        "wrapped", "replacement")


def test_hook_titan_on_train_start(pm: Any) -> None:
    calls = []

    @hookimpl
    def titan_on_train_start(job_config: Any, run_dir: str, rank: int) -> None:
        calls.append((job_config, run_dir, rank))

    pm.add_plugin(plugin("p_start", titan_on_train_start=titan_on_train_start))
    pm.hook.titan_on_train_start(job_config={"a": 1}, run_dir="/tmp/run", rank=3)
    assert calls == [({"a": 1}, "/tmp/run", 3)]


def test_hook_titan_on_step_end(pm: Any) -> None:
    seen = []

    @hookimpl
    def titan_on_step_end(step: int, metrics: dict[str, float], rank: int) -> None:  # fewer args is fine
        if rank == 0:
            seen.append((step, metrics["loss"]))

    pm.add_plugin(plugin("p_step", titan_on_step_end=titan_on_step_end))
    for step in (1, 2):
        for rank in (0, 1):
            pm.hook.titan_on_step_end(step=step, metrics={"loss": 1.0 / step}, job_config=None, rank=rank)
    assert seen == [(1, 1.0), (2, 0.5)]


def test_hook_titan_on_train_end(pm: Any) -> None:
    ends = []

    @hookimpl
    def titan_on_train_end(step: int, metrics: dict[str, float], job_config: Any, rank: int) -> None:
        ends.append((step, dict(metrics), rank))

    pm.add_plugin(plugin("p_end", titan_on_train_end=titan_on_train_end))
    pm.hook.titan_on_train_end(step=10, metrics={}, job_config=None, rank=0)
    assert ends == [(10, {}, 0)]


def test_hook_titan_on_train_error(pm: Any) -> None:
    seen = []

    @hookimpl
    def titan_on_train_error(step: int, error: str, rank: int) -> None:
        seen.append((step, error, rank))

    pm.add_plugin(plugin("p_err", titan_on_train_error=titan_on_train_error))
    pm.hook.titan_on_train_error(step=3, error="RuntimeError: boom", metrics={}, job_config=None, rank=0)
    assert seen == [(3, "RuntimeError: boom", 0)]

