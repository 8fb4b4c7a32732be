"""``titan-plugins list/show`` and ``titan-run --help`` text: in-process with the
toy plugin (``TITAN_PLUGINS_EXTRA``), plus one subprocess that proves listing
imports no torch."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from titan_plugins import API_VERSION, hookimpl
from titan_plugins.cli import plugins_cmd
from titan_plugins.cli.help import format_help
from titan_plugins.plugins import get_plugin_manager

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent


@pytest.fixture
def toy_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """Only the toy plugin (and a broken one) besides the core's built-ins."""
    monkeypatch.setenv("TITAN_PLUGINS_DISABLE_AUTOLOAD", "1")
    monkeypatch.setenv("TITAN_PLUGINS_EXTRA", "toy_plugin")
    for var in ("TITAN_PLUGINS", "TITAN_PLUGINS_BLOCK", "TITAN_TRACE_PLUGINS"):
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = plugins_cmd.main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def test_list_json(toy_env: Any, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(["list", "--json"], capsys)
    assert code == 0
    data = json.loads(out)
    assert data["core"]["dist"] == "titan-plugins" and data["core"]["api"] == API_VERSION
    (toy,) = [p for p in data["plugins"] if p["name"] == "toy_plugin"]
    assert toy["dist"] == "<extra>" and toy["error"] is None and toy["builtin"] is False
    assert toy["hooks"] == ["titan_register_datasets", "titan_register_models"]
    (model,) = toy["models"]
    assert model["name"] == "toy" and model["flavors"] == ["debugmodel", "wide"]
    assert model["default_flavor"] == "debugmodel" and model["capabilities"]["tp"] is True
    assert toy["datasets"] == ["toy_data"]
    builtin = [p for p in data["plugins"] if p["builtin"]]
    assert {p["dist"] for p in builtin} == {"titan-plugins"}
    assert data["errors"] == []


def test_list_text_shows_errors_and_stays_lenient(
    toy_env: Any, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    broken = types.ModuleType("titan_fake_broken_cli")
    broken.titan_register_modles = hookimpl(lambda register: None)
    monkeypatch.setitem(sys.modules, broken.__name__, broken)
    toy_env.setenv("TITAN_PLUGINS_EXTRA", "toy_plugin,titan_fake_broken_cli")
    code, out, _ = run(["list"], capsys)
    assert code == 0
    assert "toy_plugin  <extra>==-  (toy_plugin)  [ok]" in out
    assert "model:    toy  [debugmodel*, wide]  a toy model for the core's tests" in out
    assert "titan_fake_broken_cli" in out and "[FAILED]" in out
    assert "1 load error(s):" in out
    assert "did you mean 'titan_register_models'?" in out


def test_list_with_searchpath_shows_config_groups(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                  toy_env: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "conf" / "parallelism").mkdir(parents=True)
    (tmp_path / "conf" / "parallelism" / "tp8.yaml").write_text("tp: 8\n")
    mod = types.ModuleType("titan_fake_confcli")
    mod.titan_config_searchpath = hookimpl(lambda: f"file://{tmp_path / 'conf'}")
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    toy_env.setenv("TITAN_PLUGINS_EXTRA", "toy_plugin,titan_fake_confcli")
    code, out, _ = run(["list", "--json"], capsys)
    (p,) = [p for p in json.loads(out)["plugins"] if p["name"] == "titan_fake_confcli"]
    assert p["config_groups"] == {"parallelism": ["tp8"]}
    assert p["hooks"] == ["titan_config_searchpath"]


def test_show_model(toy_env: Any, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(["show", "toy"], capsys)
    assert code == 0
    assert out.startswith("model toy from <extra>==- (plugin 'toy_plugin', toy_plugin)")
    assert "flavors: debugmodel*, wide" in out
    lines = out.splitlines()
    header = next(line for line in lines if line.strip().startswith("key"))
    assert header.split() == ["key", "type", "debugmodel", "wide"]
    assert next(line for line in lines if line.strip().startswith("moe.top_k")).split() == ["moe.top_k", "int", "1", "2"]
    assert next(line for line in lines if line.strip().startswith("activation")).split()[1] == "{silu,"


def test_show_flavor_and_json(toy_env: Any, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(["show", "toy", "--flavor", "wide"], capsys)
    assert code == 0 and "dim: 64" in out and "num_experts: 8" in out
    code, out, _ = run(["show", "toy", "--json"], capsys)
    data = json.loads(out)
    assert data["flavors"]["wide"]["moe.num_experts"] == 8
    assert {"key": "norm_eps", "type": "float"} in data["fields"]


def test_bad_input_exits_2_with_one_line(toy_env: Any, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(["show", "tyo"], capsys)
    assert (code, out) == (2, "")
    assert err == "error: model=tyo is not provided by any installed plugin; did you mean 'toy'? (installed: toy)\n"
    code, _, err = run(["show", "toy", "--flavor", "huge"], capsys)
    assert code == 2 and err.count("\n") == 1 and "is not a flavor of model 'toy'" in err
    code, _, _ = run([], capsys)
    assert code == 2


def test_subcommands_are_a_registry() -> None:
    """Another module adds a subcommand with one line (``titan-plugins new`` later)."""
    assert set(plugins_cmd.SUBCOMMANDS) >= {"list", "show"}
    parser = plugins_cmd.build_parser()
    assert parser.parse_args(["list", "--json"]).func is plugins_cmd.run_list


def test_format_help_lists_models_and_groups(toy_env: Any) -> None:
    pm = get_plugin_manager()
    text = format_help(pm)
    assert text.startswith("usage: titan-run")
    assert "toy" in text and "from <extra>==-" in text and "flavors: debugmodel*, wide" in text
    assert re.search(r"\n  parallelism ", text) and "single*" in text and "fsdp4_tp2_ep2" in text
    assert re.search(r"\n  precision +bf16_compute, bf16_mixed, float8_rowwise, float8_tensorwise, fp32\*\n", text)
    assert re.search(r"\n  fault_tolerance +none\*, torchft\n", text)


def test_format_help_without_models(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TITAN_PLUGINS_DISABLE_AUTOLOAD", "1")
    monkeypatch.delenv("TITAN_PLUGINS_EXTRA", raising=False)
    monkeypatch.delenv("TITAN_PLUGINS", raising=False)
    assert "installed models: none" in format_help(get_plugin_manager())


def _imported_modules(importtime_stderr: str) -> set[str]:
    names = set()
    for line in importtime_stderr.splitlines():
        if line.startswith("import time:") and "|" in line:
            names.add(line.rsplit("|", 1)[1].strip())
    return names


def test_listing_does_not_import_torch() -> None:
    """With every installed plugin (autoload on) plus the toy one."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TITAN_")}
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), env.get("PYTHONPATH", "")])
    env["TITAN_PLUGINS_EXTRA"] = "toy_plugin"
    for argv in (["list", "--json"], ["show", "toy"]):
        proc = subprocess.run(
            [sys.executable, "-X", "importtime", "-m", "titan_plugins.cli.plugins_cmd", *argv],
            capture_output=True, text=True, env=env, cwd=ROOT, timeout=120,
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        modules = _imported_modules(proc.stderr)
        assert "titan_plugins.plugins" in modules and "pluggy" in modules  # the probe works
        heavy = sorted(m for m in modules if m == "torch" or m.startswith("torch."))
        assert heavy == [], f"`titan-plugins {' '.join(argv)}` imported {heavy[:5]}"
    data = json.loads(subprocess.run(
        [sys.executable, "-m", "titan_plugins.cli.plugins_cmd", "list", "--json"],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=120).stdout)
    assert any(p["name"] == "toy_plugin" for p in data["plugins"])
