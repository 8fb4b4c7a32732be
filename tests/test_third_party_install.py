"""A third party's plugin, installed with pip like any distribution, appears in
``titan-plugins list`` with no edit to the core."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

PYPROJECT = """\
[build-system]
requires = ["setuptools>=61"]
build-backend = "setuptools.build_meta"

[project]
name = "titan-thirdparty-demo"
version = "0.4.2"
dependencies = ["titan-plugins"]

[project.entry-points.titan_plugins]
thirdparty_demo = "titan_thirdparty_demo.plugin"

[tool.setuptools]
packages = ["titan_thirdparty_demo", "titan_thirdparty_demo.conf"]

[tool.setuptools.package-data]
"titan_thirdparty_demo.conf" = ["*/*.yaml"]
"""

PLUGIN = '''\
from dataclasses import dataclass

from titan_plugins import ModelSpec, hookimpl

TITAN_PLUGINS_API = ">=1.0,<2"


@dataclass
class DemoConfig:
    dim: int = 8
    n_layers: int = 1


FLAVORS = {"debugmodel": DemoConfig(), "big": DemoConfig(dim=1024, n_layers=8)}


@hookimpl
def titan_register_models(register):
    register(ModelSpec(name="demo_tp", config=DemoConfig, flavors=FLAVORS,
                       build="titan_thirdparty_demo.model:build",
                       parallelize="titan_thirdparty_demo.model:parallelize",
                       description="a third-party demo"))


@hookimpl
def titan_config_searchpath():
    return "pkg://titan_thirdparty_demo.conf"
'''


def write_project(src: Path) -> None:
    pkg = src / "titan_thirdparty_demo"
    (pkg / "conf" / "model").mkdir(parents=True)
    (src / "pyproject.toml").write_text(PYPROJECT)
    (pkg / "__init__.py").write_text("")
    (pkg / "plugin.py").write_text(PLUGIN)
    (pkg / "conf" / "__init__.py").write_text("")
    (pkg / "conf" / "model" / "demo_tp.yaml").write_text(textwrap.dedent("""\
        defaults:
          - /schema/model/demo_tp@_here_
          - _self_
        name: demo_tp
        flavor: debugmodel
        """))


def test_installed_third_party_plugin_is_listed(tmp_path: Path) -> None:
    src, site = tmp_path / "src", tmp_path / "site"
    write_project(src)
    pip = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--no-build-isolation",
         "--disable-pip-version-check", "--quiet", "--target", str(site), str(src)],
        capture_output=True, text=True, timeout=120,
    )
    assert pip.returncode == 0, pip.stderr[-3000:]
    assert list(site.glob("titan_thirdparty_demo-0.4.2.dist-info"))

    env = {k: v for k, v in os.environ.items() if not k.startswith("TITAN_")}
    env["PYTHONPATH"] = os.pathsep.join([str(site), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, "-m", "titan_plugins.cli.plugins_cmd", "list", "--json"],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (demo,) = [p for p in json.loads(proc.stdout)["plugins"] if p["name"] == "thirdparty_demo"]
    assert demo["dist"] == "titan-thirdparty-demo" and demo["version"] == "0.4.2"
    assert demo["module"] == "titan_thirdparty_demo.plugin" and demo["error"] is None
    assert demo["hooks"] == ["titan_config_searchpath", "titan_register_models"]
    assert demo["models"][0]["name"] == "demo_tp" and demo["models"][0]["flavors"] == ["debugmodel", "big"]
    assert demo["config_groups"] == {"model": ["demo_tp"]}

    # The same install composes through Hydra with the plugin's own conf/ (a bad
    # value fails with one line), and the block list hides it again.
    compose = textwrap.dedent("""\
        from titan_plugins.config import hydra_glue
        from titan_plugins.errors import ConfigError
        from titan_plugins.plugins import get_plugin_manager
        pm = get_plugin_manager(strict=True)
        spec, job = hydra_glue.resolve_job(hydra_glue.compose(["model=demo_tp", "model.flavor=big"], pm), pm)
        print(job.model.dim, pm.model_owner("demo_tp").dist)
        try:
            hydra_glue.compose(["model=demo_tp", "model.dim=wide"], pm)
        except ConfigError as exc:
            print(exc)
        """)
    proc = subprocess.run([sys.executable, "-c", compose], capture_output=True, text=True,
                          env={**env, "TITAN_PLUGINS": "thirdparty_demo"}, cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines() == [
        "1024 titan-thirdparty-demo",
        "model.dim=wide: Value 'wide' could not be converted to Integer",
    ]
    env["TITAN_PLUGINS_BLOCK"] = "thirdparty_demo"
    proc = subprocess.run(
        [sys.executable, "-m", "titan_plugins.cli.plugins_cmd", "list", "--json"],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120,
    )
    assert all(p["name"] != "thirdparty_demo" for p in json.loads(proc.stdout)["plugins"])
