"""The built wheels carry what a run needs: the Hydra tree, the shipped corpus and
tokenizer, the scaffold templates, and each plugin's ``conf/`` and entry point.

The core and every first-party plugin (titan-hf too) are built into wheels, unpacked into a
directory (a pure-Python wheel unpacked is an installed tree, ``.dist-info``
included) and used from a fresh interpreter that sees nothing of this checkout:
no site-packages, only the unpacked wheels and the non-torch libraries that
listing and composing need.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROJECTS = {"titan_plugins": ROOT, **{f"titan_{p.name}": p for p in (ROOT / "plugins").iterdir()
                                      if (p / "pyproject.toml").is_file()}}
# What `titan-plugins list` and Hydra composition import (no torch, by contract).
LIBRARIES = ("hydra", "omegaconf", "pluggy", "antlr4", "yaml", "_yaml", "packaging", "tokenizers")

CHECK = r"""
import importlib.resources, json, sys
sys.path[:0] = [sys.argv[1], sys.argv[2]]
import titan_plugins
from titan_plugins.config import hydra_glue
from titan_plugins.plugins import get_plugin_manager
from titan_plugins.data.tokenizer import DEFAULT_TOKENIZER, Tokenizer

pm = get_plugin_manager(strict=True)
out = {"core": titan_plugins.__file__, "models": sorted(pm.models())}
out["plugin_files"] = {m: sys.modules[m].__file__ for m in sorted(sys.modules) if m.startswith("titan_") and m.endswith(".plugin")}
out["groups"] = sorted(hydra_glue.list_config_options(f"pkg://{hydra_glue.CONFIG_MODULE}"))
out["composed"] = {}
for name in out["models"]:
    cfg = hydra_glue.compose([f"model={name}", "parallelism=fsdp4_tp2_ep2", "precision=bf16_mixed"], pm)
    out["composed"][name] = [cfg.model.flavor, cfg.parallelism.dp_shard, cfg.parallelism.tp, cfg.parallelism.ep]
tok = Tokenizer.load(DEFAULT_TOKENIZER)
out["vocab"] = tok.vocab_size
assets = importlib.resources.files("titan_plugins.data").joinpath("assets")
out["assets"] = sorted(p.name for p in assets.iterdir())
templates = importlib.resources.files("titan_plugins").joinpath("scaffold_template")
out["templates"] = sum(1 for p in templates.rglob("*.tmpl"))
out["torch_imported"] = "torch" in sys.modules
print(json.dumps(out))
"""


def _source_tree(project: Path, dest: Path) -> Path:
    """The project's files as git has them (tracked, or new and not ignored), copied:
    setuptools builds in place and would reuse a stale ``build/`` of the checkout."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z", "."],
        cwd=project, check=True, capture_output=True, text=True,
    ).stdout.split("\0")
    for rel in filter(None, listed):
        src, dst = project / rel, dest / rel
        if not src.exists() and not src.is_symlink():
            continue  # deleted in the working tree
        dst.parent.mkdir(parents=True, exist_ok=True)
        if src.is_symlink():
            dst.symlink_to(src.readlink())
        else:
            shutil.copy2(src, dst)
    return dest


def _build_wheels(tmp: Path) -> list[Path]:
    dest = tmp / "dist"
    for name, project in PROJECTS.items():
        source = _source_tree(project, tmp / "src" / name)
        subprocess.run(
            [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
             "-q", "-w", str(dest), str(source)],
            check=True, capture_output=True, text=True,
        )
    return sorted(dest.glob("*.whl"))


def _libraries(dest: Path) -> Path:
    dest.mkdir()
    for name in LIBRARIES:
        spec = importlib.util.find_spec(name)
        if spec is None or spec.origin is None:
            continue
        origin = Path(spec.origin)
        source = origin.parent if origin.name == "__init__.py" else origin
        (dest / source.name).symlink_to(source)
    return dest


@pytest.mark.slow
def test_wheels_alone_list_and_compose_every_first_party_model(tmp_path: Path) -> None:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs the git checkout to list the projects' files")
    wheels = _build_wheels(tmp_path)
    assert {w.name.split("-")[0] for w in wheels} == {
        "titan_plugins", "titan_deepseek_v3", "titan_llama3", "titan_llama4", "titan_qwen3", "titan_hf"
    }
    site = tmp_path / "site"
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as zf:
            zf.extractall(site)
    libs = _libraries(tmp_path / "libs")
    # -S: no site-packages (so none of this checkout's editable installs); -E: no PYTHONPATH.
    proc = subprocess.run(
        [sys.executable, "-S", "-E", "-c", CHECK, str(site), str(libs)],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    assert out["core"].startswith(str(site))
    # titan-hf lists and composes without transformers (it loads only when model=hf runs).
    assert out["models"] == ["deepseek_v3", "hf", "llama3", "llama4", "qwen3"]
    assert set(out["plugin_files"]) == {f"{p}.plugin" for p in PROJECTS if p != "titan_plugins"}
    assert all(path.startswith(str(site)) for path in out["plugin_files"].values()), out["plugin_files"]
    assert {"parallelism", "precision", "training", "data", "checkpoint", "metrics"} <= set(out["groups"])
    assert out["composed"] == {name: ["folder" if name == "hf" else "debugmodel", 4, 2, 2]
                               for name in out["models"]}
    assert out["vocab"] == 2048
    assert {"corpus.jsonl", "tokenizer.json"} <= set(out["assets"])
    assert out["templates"] > 0
    assert out["torch_imported"] is False
