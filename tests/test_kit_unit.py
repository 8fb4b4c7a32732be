"""The conformance kit itself: cheap to load, its errors, and a good model passing
the single-process checks (the scaffold and the GPT-2 example, not installed)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from titan_plugins.cli.scaffold import scaffold
from titan_plugins.testing import CONTRACTS, ContractError, Target
from titan_plugins.testing import conformance as kit
from titan_plugins.testing.conformance import Session

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def test_loading_the_kit_imports_no_torch():
    code = ("import sys, titan_plugins.testing, titan_plugins.testing.pytest_plugin; "
            "from titan_plugins.testing import ConformanceSuite; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_contract_error_names_the_contract_and_the_fix():
    err = ContractError("state-dict", "buffer 'x' is saved.", "register it non-persistent.")
    assert str(err) == "state-dict: buffer 'x' is saved. Fix: register it non-persistent."
    assert (err.contract, err.problem, err.fix) == ("state-dict", "buffer 'x' is saved", "register it non-persistent")
    assert isinstance(err, AssertionError)
    assert set(kit._FIXES) <= set(CONTRACTS)


def test_target_round_trips_and_adds_overrides_per_parallelism():
    target = Target("m", ["a=1"], ["pkg.plugin"], ["model.flavor=moe"], ["model.tied=false"])
    assert Target.from_json(target.as_json()) == target
    assert target.for_kind("ep").overrides == ("a=1", "model.flavor=moe")
    assert target.for_kind("pp").overrides == ("a=1", "model.tied=false")
    assert target.for_kind("tp") is target
    env = target.env()
    assert env["TITAN_PLUGINS_EXTRA"].split(",")[-1] == "pkg.plugin"


def test_an_unknown_model_fails_registration():
    with pytest.raises(ContractError, match=r"^registration: model=nosuchmodel is not provided"):
        kit.check_registration(Target("nosuchmodel"))


_SINGLE_PROCESS = [
    kit.check_registration, kit.check_schema, kit.check_compose, kit.check_typed_override,
    kit.check_meta_build, kit.check_init_weights, kit.check_forward_backward, kit.check_state_dict,
    kit.check_pipeline_split,
]


def test_the_scaffold_passes_the_single_process_checks(tmp_path, monkeypatch):
    root, _ = scaffold("kitgood", tmp_path / "kitgood")
    monkeypatch.syspath_prepend(str(root))
    target = Target("kitgood", overrides=("model.n_layers=2",), plugins=("titan_kitgood.plugin",))
    session = Session.open(target)  # the checks share the composed job and the initialised models
    for check in _SINGLE_PROCESS:
        assert check(session) is None, check.__name__
    # loss parity: EP is skipped with the reason when the model does not declare it (no run starts)
    assert kit.check_loss_parity(session, "ep") == "model 'kitgood' does not declare ep"
    assert kit.check_loss_parity(session, "cp") == "model 'kitgood' does not declare cp"
    assert session.workdir is None


def test_no_check_depends_on_another_having_run(tmp_path, monkeypatch):
    """The checks that use the initialised models, each first on a fresh session."""
    root, _ = scaffold("kitorder", tmp_path / "kitorder")
    monkeypatch.syspath_prepend(str(root))
    target = Target("kitorder", overrides=("model.n_layers=2",), plugins=("titan_kitorder.plugin",))
    session = Session.open(target)
    assert kit.check_state_dict(session) is None and session.initialised is not None
    assert kit.check_hf_round_trip(Session.open(target)) is None  # the scaffold maps LlamaForCausalLM


def test_the_gpt2_example_passes_the_single_process_checks(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES / "gpt2_plugin"))
    session = Session.open(Target("gpt2", overrides=("model.n_layers=2",), plugins=("titan_gpt2.plugin",)))
    for check in _SINGLE_PROCESS:
        assert check(session) is None, check.__name__


def test_a_model_yaml_not_starting_from_the_schema_fails_compose(tmp_path, monkeypatch):
    root, _ = scaffold("kituntyped", tmp_path / "kituntyped")
    yaml = root / "titan_kituntyped" / "conf" / "model" / "kituntyped.yaml"
    yaml.write_text("name: kituntyped\nflavor: debugmodel\nn_layers: 2\n")
    monkeypatch.syspath_prepend(str(root))
    target = Target("kituntyped", plugins=("titan_kituntyped.plugin",))
    with pytest.raises(ContractError) as info:
        kit.check_compose(target)
    message = str(info.value)
    assert message.startswith("hydra-compose: conf/model/kituntyped.yaml does not start from the stored schema")
    assert "Fix: start conf/model/kituntyped.yaml with `defaults: [/schema/model/kituntyped@_here_, _self_]`" in message
    # a wrongly typed value is still caught when the job is resolved, naming the key
    assert kit.check_typed_override(target) is None


def test_init_weights_that_skips_a_parameter_fails(tmp_path, monkeypatch):
    root, _ = scaffold("kitinit", tmp_path / "kitinit")
    model = root / "titan_kitinit" / "model.py"
    model.write_text(model.read_text().replace("            self.norm.reset_parameters()\n", "            pass\n"))
    monkeypatch.syspath_prepend(str(root))
    target = Target("kitinit", overrides=("model.n_layers=2",), plugins=("titan_kitinit.plugin",))
    with pytest.raises(ContractError, match=r"^init-weights: parameter 'norm.weight' is not initialised"):
        kit.check_init_weights(target)
