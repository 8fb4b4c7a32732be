"""Every parallelism preset's name states its degrees, and every preset composes.

Names are ``_``-joined ``<dim><degree>`` tokens: ``hsdp`` (dp_replicate), ``fsdp``
(dp_shard), ``cp``, ``tp``, ``pp``, ``ep``, ``etp``; a dim not named is 1; ``single`` is all 1.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import toy_plugin
import yaml

from titan_plugins.config import hydra_glue
from titan_plugins.plugins import get_plugin_manager

CONF = Path(hydra_glue.__file__).resolve().parents[1] / "conf"
PRESETS = sorted(p.stem for p in (CONF / "parallelism").glob("*.yaml"))
TOKEN = re.compile(r"^(hsdp|fsdp|cp|etp|tp|pp|ep)(\d+)$")
DIMS = {"hsdp": "dp_replicate", "fsdp": "dp_shard", "cp": "cp", "tp": "tp", "pp": "pp", "ep": "ep", "etp": "etp"}


def degrees_from_name(name: str) -> dict[str, int]:
    degrees = dict.fromkeys(DIMS.values(), 1)
    if name == "single":
        return degrees
    seen = set()
    for token in name.split("_"):
        match = TOKEN.match(token)
        assert match, f"preset {name!r}: token {token!r} is not <hsdp|fsdp|tp|pp|ep|etp><N>"
        dim = DIMS[match.group(1)]
        assert dim not in seen, f"preset {name!r} names {dim} twice"
        seen.add(dim)
        degrees[dim] = int(match.group(2))
    return degrees


def load(name: str) -> dict[str, Any]:
    return yaml.safe_load((CONF / "parallelism" / f"{name}.yaml").read_text()) or {}


def test_presets_exist() -> None:
    assert {"single", "fsdp2", "fsdp4_tp2_ep2", "fsdp2_tp2_ep2_pp2"} <= set(PRESETS)
    assert {"cp2", "fsdp2_cp2", "cp2_tp2", "fsdp2_cp2_tp2"} <= set(PRESETS)


@pytest.mark.parametrize("name", PRESETS)
def test_preset_name_states_its_degrees(name: str) -> None:
    expected = degrees_from_name(name)
    content = load(name)
    actual = {dim: int(content.get(dim, 1)) for dim in DIMS.values()}
    assert actual == expected, f"parallelism/{name}.yaml says {actual}"
    world = expected["dp_replicate"] * expected["dp_shard"] * expected["cp"] * expected["tp"] * expected["pp"]
    comment = re.search(r"world size (\d+)", (CONF / "parallelism" / f"{name}.yaml").read_text())
    if comment:
        assert int(comment.group(1)) == world, f"{name}: comment says world size {comment.group(1)}"
    # EP borrows from dp_shard x tp; ETP is 1 or TP.
    ep, tp, etp = expected["ep"], expected["tp"], expected["etp"]
    assert etp in (1, tp), f"{name}: etp={etp} must be 1 or tp={tp}"
    if ep > 1 and etp == 1:  # spans all of tp and ep/tp dp_shard ranks
        assert ep % tp == 0 and expected["dp_shard"] % (ep // tp) == 0, f"{name}: ep={ep}, tp={tp}"
    if ep > 1 and etp == tp > 1:  # spans ep dp_shard ranks
        assert expected["dp_shard"] % ep == 0, f"{name}: ep={ep}, dp_shard={expected['dp_shard']}"


@pytest.fixture(scope="module")
def pm() -> Any:
    manager = get_plugin_manager(autoload=False)
    manager.add_plugin(toy_plugin)
    return manager


@pytest.mark.parametrize("name", PRESETS)
def test_preset_composes(pm: Any, name: str) -> None:
    cfg = hydra_glue.compose(["model=toy", f"parallelism={name}"], pm)
    expected = degrees_from_name(name)
    assert {dim: cfg.parallelism[dim] for dim in DIMS.values()} == expected


@pytest.mark.parametrize("name", sorted(p.stem for p in (CONF / "precision").glob("*.yaml")))
def test_precision_preset_composes(pm: Any, name: str) -> None:
    cfg = hydra_glue.compose(["model=toy", f"precision={name}"], pm)
    assert cfg.precision.name == name


def test_name_parser_rejects_bad_names() -> None:
    with pytest.raises(AssertionError):
        degrees_from_name("fsdp2_zz4")
    with pytest.raises(AssertionError):
        degrees_from_name("tp2_tp4")
    assert degrees_from_name("hsdp2_fsdp4_tp2_ep4_etp2_pp2") == {
        "dp_replicate": 2, "dp_shard": 4, "cp": 1, "tp": 2, "pp": 2, "ep": 4, "etp": 2}
