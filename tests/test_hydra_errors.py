"""Pins titan_plugins.config.hydra_errors: one test per Hydra/OmegaConf message that
is rewritten as a one-line ConfigError. Each test checks both sides: the raw text
the rewriting reads (so a Hydra or OmegaConf upgrade that rewords it fails here,
naming the message) and the exact line the user gets."""

from __future__ import annotations

from typing import Any

import pytest
import toy_plugin
from hydra.errors import ConfigCompositionException, MissingConfigException, OverrideParseException
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, ValidationError

from titan_plugins.config import hydra_glue
from titan_plugins.errors import ConfigError, UnknownModelError
from titan_plugins.plugins import TitanPluginManager


@pytest.fixture(scope="module")
def pm() -> Any:
    """The built-ins and the toy plugin only (no env switches, no entry points)."""
    manager = TitanPluginManager()
    manager.load_builtins()
    manager.add_plugin(toy_plugin)
    return manager


def _fail(pm: Any, overrides: list[str]) -> tuple[list[BaseException], ConfigError]:
    """The raw exception chain (outermost first) and the ConfigError raised for it."""
    with pytest.raises(ConfigError) as info:
        cfg = hydra_glue.compose(overrides, pm)
        hydra_glue.resolve_job(cfg, pm)
    chain: list[BaseException] = []
    raw = info.value.__cause__
    while raw is not None and raw not in chain:
        chain.append(raw)
        raw = raw.__cause__ or raw.__context__
    assert chain, "the ConfigError must keep Hydra's error as its cause"
    assert "\n" not in str(info.value) and info.value.exit_code == 2
    return chain, info.value


def _one(chain: list[BaseException], kind: type | tuple[type, ...]) -> BaseException:
    found = [e for e in chain if isinstance(e, kind)]
    assert found, f"no {kind} in the chain: {[type(e).__name__ for e in chain]}"
    return found[0]


def test_you_must_specify_model(pm: Any) -> None:
    chain, err = _fail(pm, [])
    raw = _one(chain, ConfigCompositionException)
    assert str(raw).startswith("You must specify 'model'"), str(raw)
    assert str(err) == "model is not set: add model=<name> (installed: toy)"


def test_you_must_specify_a_group(pm: Any) -> None:
    chain, err = _fail(pm, ["model=toy", "parallelism=???"])
    assert str(_one(chain, ConfigCompositionException)).startswith("You must specify 'parallelism'")
    assert str(err) == "parallelism is not set: add parallelism=<option>"


def test_could_not_find_a_preset(pm: Any) -> None:
    chain, err = _fail(pm, ["model=toy", "parallelism=fsdp"])
    raw = str(_one(chain, MissingConfigException))
    assert "Could not find 'parallelism/fsdp'" in raw
    assert "Available options in 'parallelism':\n\t" in raw  # the list the line repeats
    available = ", ".join(hydra_glue.config_options(pm)["parallelism"])
    assert str(err) == f"parallelism=fsdp: no such preset; did you mean 'fsdp8'? (available: {available})"


def test_could_not_find_a_model(pm: Any) -> None:
    chain, err = _fail(pm, ["model=tyo"])
    assert "Could not find 'model/tyo'" in str(_one(chain, MissingConfigException))
    assert isinstance(err, UnknownModelError)  # the registry's own error, with its suggestion
    assert str(err) == "model=tyo is not provided by any installed plugin; did you mean 'toy'? (installed: toy)"


def test_override_that_does_not_parse(pm: Any) -> None:
    chain, err = _fail(pm, ["model=toy", "training.steps"])
    raw = str(_one(chain, OverrideParseException))
    assert raw.splitlines()[0] == "Error parsing override 'training.steps'"
    assert raw.splitlines()[-1].startswith("See https")  # dropped from the line
    assert str(err) == "cannot parse the override: Error parsing override 'training.steps'; missing EQUAL at '<EOF>'"


def test_key_not_in_a_core_schema(pm: Any) -> None:
    chain, err = _fail(pm, ["model=toy", "training.stesp=1"])
    raw = _one(chain, (ConfigAttributeError, ConfigKeyError))
    assert raw.full_key == "training.stesp" and "not in" in str(raw)
    assert str(err) == "training.stesp=1: key 'stesp' is not in the schema of 'training'; did you mean 'steps'?"


def test_key_not_in_the_job_schema(pm: Any) -> None:
    chain, err = _fail(pm, ["model=toy", "zzz=1"])  # near no key ("nope" now suggests 'peft')
    raw = _one(chain, (ConfigAttributeError, ConfigKeyError))
    assert raw.full_key == "zzz" and "not in" in str(raw)
    assert str(err) == "zzz=1: key 'zzz' is not in the job schema"


def test_key_not_in_a_model_schema(pm: Any) -> None:
    chain, err = _fail(pm, ["model=toy", "model.moe.topk=2"])
    raw = _one(chain, (ConfigAttributeError, ConfigKeyError))
    assert raw.full_key == "model.moe.topk" and "not in" in str(raw)
    assert str(err) == (
        "model.moe.topk=2: key 'topk' is not in the schema of model 'toy' (at model.moe); did you mean 'top_k'?")


def test_value_of_the_wrong_type(pm: Any) -> None:
    chain, err = _fail(pm, ["model=toy", "model.n_layers=abc"])
    raw = _one(chain, ValidationError)
    assert raw.full_key == "model.n_layers"
    assert str(raw).splitlines()[0] == "Value 'abc' of type 'str' could not be converted to Integer"
    assert str(err) == "model.n_layers=abc: Value 'abc' could not be converted to Integer"


def test_value_not_in_an_enum(pm: Any) -> None:
    chain, err = _fail(pm, ["model=toy", "model.activation=relu"])
    raw = _one(chain, ValidationError)
    assert raw.full_key == "model.activation"
    assert str(raw).splitlines()[0] == "Invalid value 'relu', expected one of [silu, gelu]"
    assert str(err) == "model.activation=relu: Invalid value 'relu', expected one of [silu, gelu]"


def test_added_key_not_in_a_model_schema(pm: Any) -> None:
    """``+model.x=`` passes Hydra (the model node is open to the flavor); merging
    it over the flavor with OmegaConf fails, relative to ``model``."""
    chain, err = _fail(pm, ["model=toy", "+model.bogus=1"])
    raw = _one(chain, (ConfigAttributeError, ConfigKeyError))
    assert raw.full_key == "bogus" and "not in" in str(raw)
    assert str(err) == "model.bogus=1: key 'bogus' is not in the schema of model 'toy'"


def test_saved_model_node_of_the_wrong_type(pm: Any) -> None:
    """What a rank gets from a resolved file it cannot read back into the schema."""
    spec = pm.get_model("toy")
    with pytest.raises(ConfigError) as info:
        hydra_glue.model_config({"name": "toy", "n_layers": "abc"}, spec)
    assert isinstance(info.value.__cause__, ValidationError)
    assert str(info.value) == "model.n_layers=abc: Value 'abc' could not be converted to Integer"
