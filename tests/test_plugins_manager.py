"""The plugin manager: registration, entry-point loading, one-line errors that name
the plugin, its module and distribution, allow/block lists, tracing."""

from __future__ import annotations

import importlib.metadata as metadata
import sys
import types
from typing import Any

import pytest
import toy_plugin

from titan_plugins import hookimpl
from titan_plugins.errors import DuplicateModelError, PluginLoadError, UnknownModelError
from titan_plugins.plugins import get_plugin_manager


class FakeDist:
    """What the loader reads from an ``importlib.metadata.Distribution``."""

    def __init__(self, name: str, version: str) -> None:
        self.metadata = {"Name": name}
        self.version = version


def ep(name: str, value: str) -> metadata.EntryPoint:
    return metadata.EntryPoint(name=name, value=value, group="titan_plugins")


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for var in ("TITAN_PLUGINS", "TITAN_PLUGINS_BLOCK", "TITAN_PLUGINS_DISABLE_AUTOLOAD",
                "TITAN_PLUGINS_EXTRA", "TITAN_TRACE_PLUGINS"):
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


@pytest.fixture
def pm(clean_env: pytest.MonkeyPatch) -> Any:
    manager = get_plugin_manager(autoload=False)
    manager.add_plugin(toy_plugin)
    return manager


@pytest.fixture
def installed(clean_env: pytest.MonkeyPatch) -> dict[str, types.ModuleType]:
    """Three importable plugin modules, as if installed: alpha, beta, gamma."""
    mods = {}
    for name in ("alpha", "beta", "gamma"):
        mod = toy_plugin.make_plugin(f"titan_fake_{name}.plugin", models=(f"{name}_model",))
        clean_env.setitem(sys.modules, mod.__name__, mod)
        mods[name] = mod
    return mods


def entry_points(*names: str) -> list[tuple[Any, Any]]:
    return [(ep(n, f"titan_fake_{n}.plugin"), FakeDist(f"titan-{n}", "1.2.3")) for n in names]


def assert_one_line(text: str) -> None:
    assert "\n" not in text and "Traceback" not in text, text


# ------------------------------------------------------------------ registration
def test_fixture_plugin_registers_model_and_dataset(pm: Any) -> None:
    assert set(pm.models()) == {"toy"}
    assert "toy_data" in pm.datasets() and "builtin" in pm.datasets()
    assert pm.model_owner("toy").name == "toy_plugin"
    assert pm.errors == []
    pm.raise_on_errors()  # strict mode passes


def test_unknown_model_suggests_close_name(pm: Any) -> None:
    with pytest.raises(UnknownModelError) as info:
        pm.get_model("tyo")
    assert str(info.value).startswith("model=tyo is not provided by any installed plugin; did you mean 'toy'?")
    with pytest.raises(UnknownModelError):
        pm.model_owner("nope")


def test_entry_points_are_attributed_to_their_distribution(installed: Any) -> None:
    pm = get_plugin_manager(autoload=False)
    pm.load_entrypoints(entry_points("alpha", "beta"))
    assert set(pm.models()) == {"alpha_model", "beta_model"}
    owner = pm.model_owner("beta_model")
    assert (owner.name, owner.dist, owner.version, owner.module) == (
        "beta", "titan-beta", "1.2.3", "titan_fake_beta.plugin")


def test_import_error_is_one_line_and_others_stay_usable(installed: Any) -> None:
    pm = get_plugin_manager(autoload=False)
    broken = (ep("broken", "titan_fake_missing_pkg.plugin"), FakeDist("titan-broken", "0.3"))
    pm.load_entrypoints([*entry_points("alpha"), broken, *entry_points("beta")])
    assert pm.errors == [
        "plugin 'broken' (titan_fake_missing_pkg.plugin) from titan-broken==0.3 failed to load: "
        "ModuleNotFoundError: No module named 'titan_fake_missing_pkg'"
    ]
    assert set(pm.models()) == {"alpha_model", "beta_model"}
    assert pm.infos["broken"].error.startswith("ModuleNotFoundError")
    with pytest.raises(PluginLoadError) as info:
        pm.raise_on_errors()
    assert str(info.value) == pm.errors[0]


def test_exception_at_import_time_is_reported(clean_env: pytest.MonkeyPatch) -> None:
    pm = get_plugin_manager(autoload=False)

    class Boom:
        name, value, group = "boom", "titan_fake_boom.plugin", "titan_plugins"

        def load(self) -> Any:
            raise RuntimeError("bad config\nsecond line")

    pm.load_entrypoints([(Boom(), FakeDist("titan-boom", "2.0"))])
    assert pm.errors == [
        "plugin 'boom' (titan_fake_boom.plugin) from titan-boom==2.0 failed to load: "
        "RuntimeError: bad config; second line"
    ]


def test_wrong_hook_argument(pm: Any) -> None:
    @hookimpl
    def titan_register_models(registr: Any) -> None:
        pass

    bad = toy_plugin.make_plugin("titan_fake_wrongarg")
    bad.titan_register_models = titan_register_models
    info = pm.add_plugin(bad, dist="titan-wrongarg", version="0.1")
    (line,) = pm.errors
    assert_one_line(line)
    assert line.startswith("plugin 'titan_fake_wrongarg' (titan_fake_wrongarg) from titan-wrongarg==0.1 failed to load:")
    assert "'titan_register_models'" in line and "registr" in line
    assert "titan_register_models(register" in line  # the spec's signature, to compare
    assert info.plugin is None and not pm.is_registered(bad)
    assert set(pm.models()) == {"toy"}


def test_misspelled_hook(pm: Any) -> None:
    bad = types.ModuleType("titan_fake_typo")
    bad.titan_register_model = hookimpl(lambda register: None)
    pm.add_plugin(bad, dist="titan-typo", version="1.0")
    assert pm.errors == [
        "plugin 'titan_fake_typo' (titan_fake_typo) from titan-typo==1.0 failed to load: "
        "PluginLoadError: implements unknown hook 'titan_register_model'; "
        "did you mean 'titan_register_models'?"
    ]
    assert not pm.is_registered(bad)
    assert set(pm.models()) == {"toy"}


def test_duplicate_model_names_both_distributions(installed: Any) -> None:
    pm = get_plugin_manager(autoload=False)
    pm.load_entrypoints(entry_points("alpha", "gamma"))
    clash = toy_plugin.make_plugin("titan_fake_clash.plugin", models=("alpha_model", "clash_only"))
    pm.add_plugin(clash, name="clash", dist="titan-clash", version="9.9")
    models = pm.models()
    (line,) = pm.errors
    assert line == (
        "model 'alpha_model' is registered by both titan-alpha==1.2.3 (plugin 'alpha') "
        "and titan-clash==9.9 (plugin 'clash')"
    )
    assert "alpha_model" not in models  # ambiguous: neither wins
    assert {"gamma_model", "clash_only"} <= set(models)
    with pytest.raises(DuplicateModelError, match="titan-alpha==1.2.3.*titan-clash==9.9"):
        pm.get_model("alpha_model")
    with pytest.raises(PluginLoadError):
        pm.raise_on_errors()


def test_duplicate_plugin_name_from_two_distributions(installed: Any) -> None:
    pm = get_plugin_manager(autoload=False)
    other = (ep("alpha", "titan_fake_beta.plugin"), FakeDist("titan-other", "0.1"))
    pm.load_entrypoints([*entry_points("alpha"), other])
    (line,) = pm.errors
    assert "'alpha'" in line and "titan-other==0.1" in line and "titan-alpha==1.2.3" in line
    assert set(pm.models()) == {"alpha_model"}


def test_register_hook_that_raises_or_registers_garbage(pm: Any) -> None:
    raising = types.ModuleType("titan_fake_raises")

    @hookimpl
    def titan_register_models(register: Any) -> None:
        raise ValueError("flavors are broken")

    raising.titan_register_models = titan_register_models
    garbage = types.ModuleType("titan_fake_garbage")
    garbage.titan_register_models = hookimpl(lambda register: register("not a spec"))
    pm.add_plugin(raising, dist="titan-raises", version="1")
    pm.add_plugin(garbage, dist="titan-garbage", version="1")
    assert set(pm.models()) == {"toy"}
    assert pm.errors == [
        "plugin 'titan_fake_raises' (titan_fake_raises) from titan-raises==1 failed to load: "
        "ValueError: flavors are broken",
        "plugin 'titan_fake_garbage' (titan_fake_garbage) from titan-garbage==1 failed to load: "
        "TypeError: titan_register_models: register() expects a ModelSpec, got str",
    ]
    pm.models()  # collecting again does not repeat errors
    assert len(pm.errors) == 2


def test_api_version_mismatch(pm: Any) -> None:
    from titan_plugins import API_VERSION

    future = toy_plugin.make_plugin("titan_fake_future", models=("future",), TITAN_PLUGINS_API=">=2.0")
    pm.add_plugin(future, dist="titan-future", version="3")
    (line,) = pm.errors
    assert f"needs titan-plugins API >=2.0, this core provides {API_VERSION}" in line
    assert "future" not in pm.models()


_FUTURE_PLUGIN = """
from titan_plugins import hookimpl
from titan_plugins import NameOnlyAFutureCoreHas  # would fail here with an ImportError
TITAN_PLUGINS_API = ">=7.0,<8"
"""


def test_api_range_refused_before_import(clean_env: pytest.MonkeyPatch, tmp_path: Any) -> None:
    """A plugin written for another API is refused with the version line, read from its
    source, before its module runs (running it would fail with an unrelated ImportError)."""
    from titan_plugins import API_VERSION

    (tmp_path / "titan_fake_future_pkg.py").write_text(_FUTURE_PLUGIN)
    clean_env.syspath_prepend(str(tmp_path))
    manager = get_plugin_manager(autoload=False)
    manager.load_entrypoints([(ep("future", "titan_fake_future_pkg"), FakeDist("titan-future", "9.0"))])
    (line,) = manager.errors
    assert line == (
        "plugin 'future' (titan_fake_future_pkg) from titan-future==9.0 failed to load: "
        f"PluginLoadError: needs titan-plugins API >=7.0,<8, this core provides {API_VERSION}"
    )
    assert "titan_fake_future_pkg" not in sys.modules
    assert manager.infos["future"].api == ">=7.0,<8"
    with pytest.raises(PluginLoadError, match="needs titan-plugins API >=7.0,<8"):
        manager.raise_on_errors()


def test_api_range_unparsable(pm: Any) -> None:
    odd = toy_plugin.make_plugin("titan_fake_odd", models=("odd",), TITAN_PLUGINS_API="one-point-oh")
    pm.add_plugin(odd, dist="titan-odd", version="1")
    (line,) = pm.errors
    assert "declares TITAN_PLUGINS_API = 'one-point-oh', which is not a version range" in line
    assert "odd" not in pm.models()


def test_api_range_shown_by_titan_run_list(capsys: pytest.CaptureFixture[str]) -> None:
    from titan_plugins import API_VERSION
    from titan_plugins.cli.run import main

    assert main(["--list"]) == 0
    out = capsys.readouterr().out
    assert f"(plugin API {API_VERSION})" in out.splitlines()[0]
    block = out.split("\nqwen3  ", 1)[1]
    from titan_plugins.plugins import declared_api_range

    assert block.splitlines()[1].strip() == f"api:      {declared_api_range('titan_qwen3.plugin')}"
    assert declared_api_range("titan_qwen3.plugin") == ">=1.1,<2"  # what its source says


def test_bad_searchpath_entry(pm: Any) -> None:
    bad = types.ModuleType("titan_fake_path")
    bad.titan_config_searchpath = hookimpl(lambda: "titan_fake_path/conf")
    pm.add_plugin(bad)
    assert pm.searchpath() == []
    assert "expected 'pkg://package.conf'" in pm.errors[0]


# ------------------------------------------------------------------ env switches
def test_block_list(installed: Any, clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("TITAN_PLUGINS_BLOCK", "beta, gamma")
    pm = get_plugin_manager(autoload=False)
    pm.load_entrypoints(entry_points("alpha", "beta", "gamma"))
    assert set(pm.models()) == {"alpha_model"}
    assert pm.errors == []


def test_allow_list(installed: Any, clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("TITAN_PLUGINS", "gamma")
    pm = get_plugin_manager(autoload=False)
    pm.load_entrypoints(entry_points("alpha", "beta", "gamma"))
    assert set(pm.models()) == {"gamma_model"}


def test_allow_list_names_a_missing_plugin(installed: Any, clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("TITAN_PLUGINS", "alpha,alpah")
    pm = get_plugin_manager(autoload=False)
    pm.load_entrypoints(entry_points("alpha", "beta"))
    assert set(pm.models()) == {"alpha_model"}
    (line,) = pm.errors
    assert "TITAN_PLUGINS names 'alpah' but no installed distribution provides it" in line


def test_disable_autoload(installed: Any, clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("TITAN_PLUGINS_DISABLE_AUTOLOAD", "1")
    pm = get_plugin_manager(autoload=False)
    pm.load_entrypoints(entry_points("alpha", "beta"))
    assert pm.models() == {}
    clean_env.setenv("TITAN_PLUGINS", "beta")  # like pytest: named ones still load
    pm = get_plugin_manager(autoload=False)
    pm.load_entrypoints(entry_points("alpha", "beta"))
    assert set(pm.models()) == {"beta_model"}


def test_disable_autoload_skips_real_discovery(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("TITAN_PLUGINS_DISABLE_AUTOLOAD", "1")
    pm = get_plugin_manager()
    assert pm.models() == {}
    assert {i.name for i in pm.infos.values()} == {"titan_plugins.builtin", "titan_plugins.data.builtin"}


def test_extra_modules_by_name(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("TITAN_PLUGINS_EXTRA", "toy_plugin,titan_fake_nowhere")
    pm = get_plugin_manager(autoload=False)
    assert set(pm.models()) == {"toy"}
    assert pm.model_owner("toy").dist == "<extra>"
    (line,) = pm.errors
    assert line.startswith("plugin 'titan_fake_nowhere' (titan_fake_nowhere) from <extra>==- failed to load: "
                           "ModuleNotFoundError")


def test_trace_plugins_writes_hook_calls_to_stderr(
    clean_env: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    clean_env.setenv("TITAN_TRACE_PLUGINS", "1")
    pm = get_plugin_manager(autoload=False)
    pm.add_plugin(toy_plugin)
    pm.models()
    pm.hook.titan_on_step_end(step=3, metrics={"loss": 1.0}, job_config=None, rank=0)
    err = capsys.readouterr().err
    assert "titan_register_models [toy_plugin from <local>]" in err
    assert "titan_on_step_end" in err and "step: 3" in err


def test_managers_are_independent(pm: Any) -> None:
    other = get_plugin_manager(autoload=False)
    assert "toy" in pm.models() and "toy" not in other.models()


def test_main_wrapper_turns_titan_errors_into_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    from titan_plugins.cli.errors import main_wrapper

    @main_wrapper
    def main(argv: Any) -> int:
        raise UnknownModelError("model=x is not provided\nby any plugin")

    assert main([]) == 2
    assert capsys.readouterr().err == "error: model=x is not provided by any plugin\n"


def test_register_hooks_go_through_pluggy_ordering(pm: Any) -> None:
    """tryfirst/trylast decide which plugin's register hook runs first (registration
    order decides nothing else: a clash still names the first registered)."""
    calls: list[str] = []
    last = types.ModuleType("titan_fake_last")
    last.titan_register_models = hookimpl(trylast=True)(lambda register: calls.append("last"))
    first = types.ModuleType("titan_fake_first")
    first.titan_register_models = hookimpl(tryfirst=True)(lambda register: calls.append("first"))
    plain = types.ModuleType("titan_fake_plain")
    plain.titan_register_models = hookimpl(lambda register: calls.append("plain"))
    for plugin in (last, first, plain):
        pm.add_plugin(plugin)
    pm.models()
    assert calls.index("first") == 0 and calls[-1] == "last"
    assert pm.errors == []


def test_register_hook_wrapper_runs(pm: Any) -> None:
    wrapping = types.ModuleType("titan_fake_wrapping")

    @hookimpl(wrapper=True)
    def titan_register_models(register: Any) -> Any:
        result = yield
        register(toy_plugin.spec("wrapped"))
        return result

    wrapping.titan_register_models = titan_register_models
    pm.add_plugin(wrapping)
    assert set(pm.models()) == {"toy", "wrapped"}
    assert pm.model_owner("wrapped").name == "titan_fake_wrapping"


def test_failures_are_records_until_printed(installed: Any) -> None:
    pm = get_plugin_manager(autoload=False)
    broken = (ep("broken", "titan_fake_missing_pkg.plugin"), FakeDist("titan-broken", "0.3"))
    pm.load_entrypoints([*entry_points("alpha"), broken])
    (failure,) = pm.failures
    assert (failure.plugin, failure.module, failure.dist, failure.version) == (
        "broken", "titan_fake_missing_pkg.plugin", "titan-broken", "0.3")
    assert failure.reason == "ModuleNotFoundError: No module named 'titan_fake_missing_pkg'"
    assert pm.errors == [failure.line()]
    with pytest.raises(AttributeError):
        failure.reason = "changed"  # frozen: what was recorded stays recorded


def test_api_requirement_is_a_pep440_specifier(pm: Any) -> None:
    from titan_plugins.plugins import api_version_matches

    assert api_version_matches(">=1.0,<2") and api_version_matches("~=1.0") and api_version_matches("==1.*")
    assert not api_version_matches(">=2.0") and not api_version_matches("<1")
    with pytest.raises(ValueError, match="cannot parse API requirement 'one'"):
        api_version_matches("one")
