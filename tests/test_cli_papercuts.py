"""What a third-party author hit with titan-run's ``--cfg job`` and ``--help`` (issue 18):
one line and exit 2 without a model, the flavor's values (not ``???``) with one, and
a ``--help`` that suggests nothing only a checkout has."""

from __future__ import annotations

from titan_plugins.cli.help import format_help
from titan_plugins.cli.run import main
from titan_plugins.cli.scaffold import scaffold
from titan_plugins.plugins import get_plugin_manager


def test_cfg_job_without_a_model_is_one_line(capsys):
    assert main(["--cfg", "job"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith("error: model is not set: add model=<name>") and err.count("\n") == 1, err


def test_cfg_job_shows_the_flavor_values(tmp_path, monkeypatch, capsys):
    root, _ = scaffold("cfgshow", tmp_path / "cfgshow")
    monkeypatch.syspath_prepend(str(root))
    monkeypatch.setenv("TITAN_PLUGINS_EXTRA", "titan_cfgshow.plugin")
    assert main(["--cfg", "job", "model=cfgshow", "model.n_layers=3"]) == 0
    out = capsys.readouterr().out
    assert "???" not in out, out
    assert "name: cfgshow" in out and "n_layers: 3" in out and "\nparallelism:" in out, out
    # -p/--package prints one node, as Hydra's --package does
    assert main(["-c", "job", "model=cfgshow", "-p", "model"]) == 0
    node = capsys.readouterr().out
    assert node.startswith("name: cfgshow\n") and "???" not in node, node
    # a bad override is the run's one-line error, not a traceback
    assert main(["--cfg", "job", "model=cfgshow", "model.n_layers=abc"]) == 2
    assert capsys.readouterr().err.startswith("error: model.n_layers=abc")


def test_help_without_models_suggests_no_checkout_path(monkeypatch):
    monkeypatch.delenv("TITAN_PLUGINS_EXTRA", raising=False)
    text = format_help(get_plugin_manager(autoload=False))
    assert "installed models: none" in text
    assert "plugins/" not in text and "titan-plugins new NAME" in text, text
