"""Hydra composition through the compose API: the config tree, typed schemas,
plugin search paths, and bad input that fails with one line naming key and value."""

from __future__ import annotations

import importlib.resources
import os
import types
from pathlib import Path
from typing import Any

import pytest
import toy_plugin
from hydra.core.config_search_path import ConfigSearchPath
from hydra.core.global_hydra import GlobalHydra
from omegaconf import OmegaConf

from titan_plugins import hookimpl
from titan_plugins.config import hydra_glue
from titan_plugins.errors import ConfigError, UnknownModelError
from titan_plugins.plugins import get_plugin_manager

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def pm(monkeypatch: pytest.MonkeyPatch) -> Any:
    for var in ("TITAN_PLUGINS", "TITAN_PLUGINS_BLOCK", "TITAN_PLUGINS_EXTRA"):
        monkeypatch.delenv(var, raising=False)
    manager = get_plugin_manager(autoload=False)
    manager.add_plugin(toy_plugin)
    return manager


def test_defaults_compose_every_group(pm: Any) -> None:
    cfg = hydra_glue.compose(["model=toy"], pm)
    assert set(cfg) >= {"model", "parallelism", "precision", "training", "data", "checkpoint", "metrics", "plan"}
    assert cfg.parallelism.dp_shard == 1 and cfg.precision.name == "fp32"
    assert cfg.data.name == "builtin" and cfg.checkpoint.enabled is False
    assert cfg.model.name == "toy" and cfg.model.flavor == "debugmodel"
    assert "hydra" not in cfg


def test_flavor_then_overrides(pm: Any) -> None:
    cfg = hydra_glue.compose(["model=toy", "model.flavor=wide", "model.n_layers=5",
                              "model.moe.top_k=1", "model.activation=gelu"], pm)
    spec, job = hydra_glue.resolve_job(cfg, pm)
    assert spec.name == "toy"
    assert job.model.dim == 64 and job.model.n_layers == 5 and job.model.moe.num_experts == 8
    assert job.model.moe.top_k == 1 and job.model.activation == "gelu"
    # What ranks do: rebuild the dataclass from the saved file with OmegaConf alone.
    loaded = OmegaConf.create(OmegaConf.to_yaml(job))
    config = hydra_glue.model_config(loaded.model, spec)
    assert isinstance(config, toy_plugin.ToyConfig)
    assert config.activation is toy_plugin.Activation.gelu and config.moe.num_experts == 8


def test_typed_overrides_of_core_groups(pm: Any) -> None:
    cfg = hydra_glue.compose(["model=toy", "training.steps=7", "training.lr=1e-4",
                              "parallelism=fsdp2_tp2", "precision=bf16_mixed"], pm)
    assert cfg.training.steps == 7 and cfg.training.lr == pytest.approx(1e-4)
    assert (cfg.parallelism.dp_shard, cfg.parallelism.tp) == (2, 2)
    assert cfg.precision.param_dtype.value == "bfloat16"


def test_plan_switch_is_normalized(pm: Any) -> None:
    assert hydra_glue.normalize_overrides(["plan=true", "plan=False", "plan.world_size=8"]) == [
        "plan.enabled=true", "plan.enabled=false", "parallelism.world_size=8"]
    cfg = hydra_glue.compose(["model=toy", "plan=true", "plan.world_size=64"], pm)
    assert cfg.plan.enabled is True and cfg.parallelism.world_size == 64
    assert "world_size" not in cfg.plan  # one world-size key: parallelism.world_size
    swept = hydra_glue.normalize_overrides(["plan.world_size=8,16"])  # a multirun sweep stays one
    assert swept == ["parallelism.world_size=8,16"]


BAD = [
    (["model=toy", "model.n_layers=abc"], "model.n_layers=abc: Value 'abc' could not be converted to Integer"),
    (["model=toy", "training.steps=1.5"], "training.steps=1.5: Value '1.5' could not be converted to Integer"),
    (["model=toy", "model.activation=relu"],
     "model.activation=relu: Invalid value 'relu', expected one of [silu, gelu]"),
    (["model=toy", "model.bogus=1"], "model.bogus=1: key 'bogus' is not in the schema of model 'toy'"),
    (["model=toy", "+model.bogus=1"], "model.bogus=1: key 'bogus' is not in the schema of model 'toy'"),
    (["model=toy", "model.moe.topk=2"],
     "model.moe.topk=2: key 'topk' is not in the schema of model 'toy' (at model.moe); did you mean 'top_k'?"),
    (["model=toy", "training.stesp=1"],
     "training.stesp=1: key 'stesp' is not in the schema of 'training'; did you mean 'steps'?"),
    (["model=toy", "training.bogus=1"], "training.bogus=1: key 'bogus' is not in the schema of 'training'"),
    (["model=toy", "nope=1"], "nope=1: key 'nope' is not in the job schema"),
    (["model=toy", "parallelism=nope"], "parallelism=nope: no such preset (available: cp2, cp2_tp2, fsdp16_tp8_ep64_pp16, fsdp2, "),
    (["model=toy", "precision=fp33"], "precision=fp33: no such preset; did you mean 'fp32'? (available: "),
    (["model=tyo"], "model=tyo is not provided by any installed plugin; did you mean 'toy'? (installed: toy)"),
    (["model=toy", "model.flavor=big"], "model.flavor='big' is not a flavor of model 'toy' (choose from: debugmodel, wide)"),
    ([], "model is not set: add model=<name> (installed: toy)"),
    (["model=toy", "training.steps"], "cannot parse the override: "),
]


@pytest.mark.parametrize(("overrides", "expected"), BAD, ids=[" ".join(o) or "empty" for o, _ in BAD])
def test_bad_input_is_one_line_naming_key_and_value(pm: Any, overrides: list[str], expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        cfg = hydra_glue.compose(overrides, pm)
        hydra_glue.resolve_job(cfg, pm)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(expected), message
    assert info.value.exit_code == 2


def test_unknown_model_error_type(pm: Any) -> None:
    with pytest.raises(UnknownModelError):
        hydra_glue.compose(["model=toyy"], pm)


def test_config_store_follows_the_current_manager(pm: Any) -> None:
    hydra_glue.compose(["model=toy"], pm)
    other = get_plugin_manager(autoload=False)
    other.add_plugin(toy_plugin.make_plugin("titan_fake_other", models=("other",)))
    hydra_glue.compose(["model=other"], other)
    with pytest.raises(UnknownModelError):
        hydra_glue.compose(["model=toy"], other)  # not left over from the first manager


def _conf_plugin(tmp_path: Path) -> types.ModuleType:
    """A plugin shipping its own conf/: model/toy.yaml and a parallelism preset."""
    conf = tmp_path / "conf"
    (conf / "model").mkdir(parents=True)
    (conf / "parallelism").mkdir()
    (conf / "model" / "toy.yaml").write_text(
        "defaults:\n  - /schema/model/toy@_here_\n  - _self_\nname: toy\nflavor: wide\nn_layers: 3\n")
    (conf / "parallelism" / "tp8.yaml").write_text("dp_shard: 1\ntp: 8\n")
    mod = types.ModuleType("titan_fake_conf")
    mod.titan_register_models = toy_plugin.titan_register_models
    mod.titan_config_searchpath = hookimpl(lambda: f"file://{conf}")
    return mod


def test_plugin_conf_reaches_the_search_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pm = get_plugin_manager(autoload=False)
    pm.add_plugin(_conf_plugin(tmp_path), dist="titan-conf", version="0.2")
    cfg = hydra_glue.compose(["model=toy", "parallelism=tp8"], pm)
    assert cfg.model.flavor == "wide" and cfg.model.n_layers == 3 and cfg.parallelism.tp == 8
    _, job = hydra_glue.resolve_job(cfg, pm)
    assert job.model.dim == 64 and job.model.n_layers == 3
    with pytest.raises(ConfigError, match=r"^model.n_layers=x: Value 'x' could not be converted to Integer$"):
        hydra_glue.compose(["model=toy", "model.n_layers=x"], pm)
    # The provider of each entry names the distribution (what `--info searchpath` prints).
    from hydra._internal.config_search_path_impl import ConfigSearchPathImpl

    search_path: ConfigSearchPath = ConfigSearchPathImpl()
    hydra_glue.TitanSearchPathPlugin().manipulate_search_path(search_path)
    entries = [(e.provider, e.path) for e in search_path.get_path()]
    assert entries == [("titan-conf (titan_fake_conf)", f"file://{tmp_path / 'conf'}")]
    options = hydra_glue.config_options(pm)
    assert options["parallelism"]["tp8"] == "titan-conf (titan_fake_conf)"
    assert options["parallelism"]["fsdp2"] == "titan-plugins"


def test_searchpath_entries_reach_hydra_with_provider(tmp_path: Path) -> None:
    from hydra import initialize_config_module

    pm = get_plugin_manager(autoload=False)
    pm.add_plugin(_conf_plugin(tmp_path), dist="titan-conf", version="0.2")
    hydra_glue.register_configs(pm)
    GlobalHydra.instance().clear()
    try:
        with initialize_config_module(config_module=hydra_glue.CONFIG_MODULE, version_base="1.3"):
            loader = GlobalHydra.instance().config_loader()
            providers = {(s.provider, s.path) for s in loader.get_sources()}
    finally:
        GlobalHydra.instance().clear()
    assert ("titan-conf (titan_fake_conf)", str(tmp_path / "conf")) in providers  # Hydra drops file://


def test_conf_tree_ships_in_the_package() -> None:
    """conf/ is the package titan_plugins.conf (works from a checkout, an editable
    install and a wheel: the YAML files are package data)."""
    root = importlib.resources.files(hydra_glue.CONFIG_MODULE)
    assert root.joinpath("train.yaml").is_file()
    groups = hydra_glue.list_config_options(f"pkg://{hydra_glue.CONFIG_MODULE}")
    assert {"parallelism", "precision", "training", "data", "checkpoint", "metrics"} <= set(groups)
    assert (ROOT / "conf").resolve() == (ROOT / "titan_plugins" / "conf").resolve()
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert '"titan_plugins.conf" = ["*.yaml", "*/*.yaml"]' in pyproject
    nested = [p for p in (ROOT / "titan_plugins" / "conf").rglob("*.yaml")
              if len(p.relative_to(ROOT / "titan_plugins" / "conf").parts) > 2]
    assert nested == [], "package-data only ships conf/*.yaml and conf/*/*.yaml"


def test_every_group_option_composes(pm: Any) -> None:
    options = hydra_glue.config_options(pm)
    for group, names in options.items():
        if group == "parallelism":
            continue  # every preset: tests/test_presets.py
        for name in names:
            cfg = hydra_glue.compose(["model=toy", f"{group}={name}"], pm)
            assert cfg[group] is not None, f"{group}={name}"


def test_first_party_main_job_composes() -> None:
    """The Quickstart's job composes with the installed first-party plugin."""
    if os.environ.get("TITAN_PLUGINS_DISABLE_AUTOLOAD"):
        pytest.skip("autoload disabled")
    pm = get_plugin_manager()
    if "deepseek_v3" not in pm.models():
        pytest.skip("titan-deepseek-v3 is not installed")
    cfg = hydra_glue.compose(["model=deepseek_v3", "parallelism=fsdp4_tp2_ep2"], pm)
    spec, job = hydra_glue.resolve_job(cfg, pm)
    assert spec.name == "deepseek_v3" and job.parallelism.ep == 2
