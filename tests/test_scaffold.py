"""``titan-plugins new``: the generated plugin installs, lists, trains and passes
its own tests; ``titan-plugins new NAME --objective`` likewise for an objective package.

The install goes into a temporary target directory (``pip install --target``),
never into the project's environment; the commands run in subprocesses with
``PYTHONPATH`` pointing there (entry points are found through its dist-info).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from titan_plugins import __version__
from titan_plugins.cli.plugins_cmd import main as plugins_main
from titan_plugins.cli.scaffold import names_for, scaffold
from titan_plugins.errors import ConfigError

BIN = Path(sys.executable).parent
EXPECTED = [
    "README.md",
    "pyproject.toml",
    "tests/test_mymodel.py",
    "titan_mymodel/__init__.py",
    "titan_mymodel/conf/__init__.py",
    "titan_mymodel/conf/model/mymodel.yaml",
    "titan_mymodel/config.py",
    "titan_mymodel/hf.py",
    "titan_mymodel/model.py",
    "titan_mymodel/parallelize.py",
    "titan_mymodel/plugin.py",
    "titan_mymodel/py.typed",
]


def test_names_derived_from_the_model_name():
    assert names_for("my_model") == {
        "name": "my_model", "package": "titan_my_model", "dist": "titan-my-model", "Class": "MyModel",
    }
    for bad in ("MyModel", "1model", "my-model", "class", ""):
        with pytest.raises(ConfigError, match="is not valid"):
            names_for(bad)


def test_new_writes_a_complete_package(tmp_path, capsys):
    dest = tmp_path / "out"
    assert plugins_main(["new", "mymodel", "--dir", str(dest)]) == 0
    written = sorted(str(p.relative_to(dest)) for p in dest.rglob("*") if p.is_file())
    assert written == EXPECTED
    out = capsys.readouterr().out
    assert "wrote 12 files" in out and "titan-run model=mymodel parallelism=fsdp2_tp2" in out
    pyproject = (dest / "pyproject.toml").read_text()
    assert '[project.entry-points.titan_plugins]\nmymodel = "titan_mymodel.plugin"' in pyproject
    for path in dest.rglob("*"):
        if path.is_file():
            assert "{{" not in path.read_text(), f"unrendered placeholder in {path}"
    # plugin.py and config.py are torch-free; the YAML starts from the stored schema
    assert "import torch" not in (dest / "titan_mymodel/plugin.py").read_text()
    assert "/schema/model/mymodel@_here_" in (dest / "titan_mymodel/conf/model/mymodel.yaml").read_text()
    # the Hugging Face parts: both maps declared once, referenced from the ModelSpec
    plugin, hf = ((dest / "titan_mymodel" / f).read_text() for f in ("plugin.py", "hf.py"))
    for ref in ('state_dict_adapter="titan_mymodel.hf:MymodelStateDictAdapter"',
                'config_from_hf="titan_mymodel.hf:config_from_hf"', 'config_to_hf="titan_mymodel.hf:config_to_hf"'):
        assert ref in plugin
    assert "MAP = HFConfigMap(" in hf and "MAPPING = HFMapping(" in hf
    assert "load_hf_model" in (dest / "tests/test_mymodel.py").read_text()
    # it declares the API it was generated for, read as the loader reads it (source only)
    import ast

    from titan_plugins import API_VERSION
    from titan_plugins.plugins import api_mismatch

    declared = [n.value.value for n in ast.parse(plugin).body if isinstance(n, ast.Assign)
                and n.targets[0].id == "TITAN_PLUGINS_API"]
    assert declared == [f">={API_VERSION},<{int(API_VERSION.split('.')[0]) + 1}"]
    assert api_mismatch(declared[0]) is None


def test_generated_hf_mapping_loads_transformers_llama_config(tmp_path, monkeypatch):
    """config_from_hf accepts what transformers writes for LlamaForCausalLM and refuses
    what the model cannot honour; the declared names cover the state dict both ways."""
    transformers = pytest.importorskip("transformers")
    root, _ = scaffold("scafhf", tmp_path / "gen")
    monkeypatch.syspath_prepend(str(root))
    from titan_scafhf.config import FLAVORS
    from titan_scafhf.hf import config_from_hf, config_to_hf

    saved = tmp_path / "cfg"
    transformers.LlamaConfig(**config_to_hf(FLAVORS["debugmodel"])).save_pretrained(saved)
    written = json.loads((saved / "config.json").read_text())
    values = config_from_hf(written)
    assert values["dim"] == 64 and values["n_kv_heads"] == 2 and values["rope_theta"] == 10000.0
    for field, value, why in (("hidden_act", "gelu", "implements only 'silu'"),
                              ("rope_parameters", {"rope_type": "llama3", "rope_theta": 1.0}, "plain RoPE"),
                              ("sliding_window", 128, "not understood")):
        with pytest.raises(ConfigError, match=f"^config.json: {field}=.*{why}"):
            config_from_hf({**written, field: value})


def test_new_refuses_a_non_empty_directory_and_taken_names(tmp_path, capsys):
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "keep.txt").write_text("mine")
    assert plugins_main(["new", "mymodel", "--dir", str(tmp_path / "x")]) == 2
    assert "already exists and is not an empty directory" in capsys.readouterr().err
    assert plugins_main(["new", "Bad-Name", "--dir", str(tmp_path / "y")]) == 2
    assert "error: plugin name 'Bad-Name' is not valid" in capsys.readouterr().err
    assert not (tmp_path / "y").exists()


@pytest.mark.parametrize("kind", ["model", "objective"])
def test_generated_python_is_ruff_clean(tmp_path, kind):
    ruff = shutil.which("ruff", path=str(BIN)) or shutil.which("ruff")
    if ruff is None:
        pytest.skip("ruff is not installed")
    root, _ = scaffold("mymodel", tmp_path / "gen", kind)
    proc = subprocess.run([ruff, "check", "--no-cache", "--isolated", "--select", "E,F,I,UP,B",
                           "--ignore", "E501,B905", "--line-length", "110", str(root)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _installed_env(root, site):
    """pip-install the generated package into ``site`` (no deps, no index) and return an
    environment whose processes import it, one intra-op thread each."""
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--no-build-isolation",
         "--target", str(site), str(root)],
        check=True, capture_output=True, text=True, timeout=300,
    )
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")])),
            "OMP_NUM_THREADS": "1"}


@pytest.mark.slow
@pytest.mark.extended  # ~90 s; test_third_party_install covers installing a plugin, the fast scaffold tests its files
def test_generated_plugin_installs_lists_trains_and_passes_its_tests(tmp_path):
    root, _ = scaffold("scaffoldgpt", tmp_path / "titan-scaffoldgpt")
    env = _installed_env(root, tmp_path / "site")
    env.pop("TITAN_PLUGINS_EXTRA", None)

    listed = subprocess.run([BIN / "titan-plugins", "list", "--json"], capture_output=True, text=True,
                            env=env, timeout=120, check=True)
    plugins = {p["name"]: p for p in json.loads(listed.stdout)["plugins"]}
    assert plugins["scaffoldgpt"]["dist"] == "titan-scaffoldgpt"
    assert plugins["scaffoldgpt"]["error"] is None
    assert [m["name"] for m in plugins["scaffoldgpt"]["models"]] == ["scaffoldgpt"]
    assert plugins["scaffoldgpt"]["config_groups"] == {"model": ["scaffoldgpt"]}

    run_dir = tmp_path / "run"
    train = subprocess.run(
        [BIN / "titan-run", "model=scaffoldgpt", "parallelism=fsdp2_tp2", "training.steps=3",
         "metrics.tensorboard=false", f"hydra.run.dir={run_dir}"],
        capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path,
    )
    assert train.returncode == 0, train.stdout[-2000:] + train.stderr[-2000:]
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    losses = [s["loss"] for s in steps if "loss" in s]
    assert len(losses) == 3 and all(0 < x < 20 for x in losses), steps

    # Its own tests (the conformance kit), without the 2-rank training runs that
    # the examples' tests cover; running them from the installed copy's checkout.
    tests = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not titan_slow"],
        capture_output=True, text=True, env=env, timeout=600, cwd=root,
    )
    assert tests.returncode == 0, tests.stdout[-3000:] + tests.stderr[-2000:]
    assert "failed" not in tests.stdout and " passed" in tests.stdout


# ------------------------------------------------------------- --objective
OBJECTIVE_FILES = ["README.md", "pyproject.toml", "tests/test_myloss.py", "titan_myloss/__init__.py",
                   "titan_myloss/objective.py", "titan_myloss/py.typed"]


def test_new_objective_writes_a_complete_package(tmp_path, capsys):
    dest = tmp_path / "out"
    assert plugins_main(["new", "myloss", "--objective", "--dir", str(dest)]) == 0
    assert sorted(str(p.relative_to(dest)) for p in dest.rglob("*") if p.is_file()) == OBJECTIVE_FILES
    out = capsys.readouterr().out
    assert "wrote 6 files" in out and "distribution titan-myloss-objective" in out
    assert "titan-run model=qwen3 data=chat_sample objective.name=myloss" in out
    pyproject = (dest / "pyproject.toml").read_text()
    assert '[project.entry-points."titan_plugins.objectives"]\nmyloss = "titan_myloss:SPEC"' in pyproject
    assert 'name = "titan-myloss-objective"' in pyproject
    for path in dest.rglob("*"):
        if path.is_file():
            assert "{{" not in path.read_text(), f"unrendered placeholder in {path}"
    assert "import torch" not in (dest / "titan_myloss/__init__.py").read_text()  # listing imports it


def test_generated_objective_builds_trains_its_loss_and_refuses_a_bad_knob(tmp_path, monkeypatch):
    """In process, without installing: its entry point (as pyproject declares it) is
    discovered, builds the Objective, whose loss is the weighted token-mean NLL."""
    import tomllib
    from importlib.metadata import EntryPoint

    import torch
    from omegaconf import OmegaConf

    from titan_plugins.loss.token_loss import IGNORE_INDEX
    from titan_plugins.objectives import build_objective, discover

    root, _ = scaffold("scafobj", tmp_path / "gen", "objective")
    monkeypatch.syspath_prepend(str(root))
    declared = tomllib.loads((root / "pyproject.toml").read_text())["project"]["entry-points"]
    (name, value), = declared["titan_plugins.objectives"].items()
    reg = discover([(EntryPoint(name, value, "titan_plugins.objectives"), "titan-scafobj-objective==0.1.0")])
    assert not reg.errors and reg.origins["scafobj"] == "titan-scafobj-objective==0.1.0"
    objective = build_objective(OmegaConf.create({"name": "scafobj", "options": {"weight": 3.0}}), reg)
    assert objective.describe() == "scafobj (weight 3)"
    torch.manual_seed(0)
    logits, labels = torch.randn(2, 5, 7), torch.randint(0, 7, (2, 5))
    labels[1, :4] = IGNORE_INDEX
    count = float(objective.count(labels))
    loss, sums = objective.loss(logits, labels, scale=count)
    keep = labels != IGNORE_INDEX
    want = torch.nn.functional.cross_entropy(logits[keep], labels[keep])
    assert count == 6.0
    torch.testing.assert_close(loss, 3.0 * want)
    torch.testing.assert_close(objective.metrics({k: float(v) for k, v in sums.items()}, count)["scafobj/nll"],
                               want.item())
    bad = build_objective(OmegaConf.create({"name": "scafobj", "options": {"weight": 0}}), reg)
    with pytest.raises(ConfigError, match=r"^objective.options.weight=0: must be > 0 \(objective.name=scafobj\)$"):
        bad.check(OmegaConf.create({}))


def test_new_objective_refuses_a_taken_name(tmp_path, capsys):
    assert plugins_main(["new", "dpo", "--objective", "--dir", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: objective 'dpo' is already provided by titan-plugins=={__version__}; "
                   "choose another name"]
    assert not (tmp_path / "x").exists()


@pytest.mark.slow
@pytest.mark.extended  # ~60 s; the fast tests above check its files, its entry point and its loss in process
def test_generated_objective_installs_lists_trains_and_passes_its_tests(tmp_path):
    root, _ = scaffold("scafloss", tmp_path / "titan-scafloss-objective", "objective")
    env = _installed_env(root, tmp_path / "site")
    listed = subprocess.run([BIN / "titan-plugins", "list", "--json"], capture_output=True, text=True,
                            env=env, timeout=120, check=True)
    objectives = {o["name"]: o for o in json.loads(listed.stdout)["objectives"]}
    assert objectives["scafloss"]["origin"] == "titan-scafloss-objective==0.1.0"

    run_dir = tmp_path / "run"
    train = subprocess.run(
        [BIN / "titan-run", "model=qwen3", "model.n_layers=1", "model.dim=32", "model.n_heads=2",
         "model.n_kv_heads=1", "model.head_dim=16", "model.hidden_dim=64", "training.seq_len=32",
         "training.steps=2", "data=chat_sample", "objective.name=scafloss", "+objective.options.weight=2.0",
         "metrics.tensorboard=false", f"hydra.run.dir={run_dir}"],
        capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path,
    )
    assert train.returncode == 0, train.stdout[-2000:] + train.stderr[-2000:]
    assert "scafloss (weight 2)" in train.stdout  # the header's objective line
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if '"step"' in line]
    assert len(steps) == 2 and all(s["loss"] == pytest.approx(2.0 * s["scafloss/nll"]) for s in steps), steps

    tests = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"],
                           capture_output=True, text=True, env=env, timeout=600, cwd=root)
    assert tests.returncode == 0, tests.stdout[-3000:] + tests.stderr[-2000:]
    assert "4 passed" in tests.stdout, tests.stdout[-2000:]
