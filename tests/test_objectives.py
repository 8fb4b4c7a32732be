"""The objective seam (titan_plugins/objectives): discovery from the entry-point group
``titan_plugins.objectives`` with one-line errors, the default ``objective=sft`` equal
to the plain token loss bit for bit, and DPO's checks before launch."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

from titan_plugins import __version__
from titan_plugins.errors import ConfigError
from titan_plugins.loss.token_loss import IGNORE_INDEX, GlobalTokenLoss
from titan_plugins.objectives import ObjectiveSpec, build_objective, discover
from titan_plugins.objectives.dpo import DPOObjective, pair_losses
from titan_plugins.objectives.sft import SFTObjective

SPEC = ObjectiveSpec(name="mine", build="titan_plugins.objectives.sft:SFTObjective", description="x")


class _EP:
    def __init__(self, name, value, obj=None, exc=None):
        self.name, self.value, self._obj, self._exc = name, value, obj, exc

    def load(self):
        if self._exc:
            raise self._exc
        return self._obj


def test_builtins_and_an_installed_objective_are_discovered():
    reg = discover([(_EP("mine", "pkg.mod:SPEC", SPEC), "my-dist==1.0")])
    assert {"sft", "dpo", "mine"} <= set(reg.specs) and not reg.errors
    assert reg.origins["mine"] == "my-dist==1.0"
    assert isinstance(build_objective(OmegaConf.create({"name": "mine"}), reg), SFTObjective)


@pytest.mark.parametrize("ep, message", [
    (_EP("bad", "pkg.bad:SPEC", exc=ImportError("no module named pkg")),
     "objective 'bad' (pkg.bad:SPEC) from bad-dist==2 failed to load: ImportError: no module named pkg"),
    (_EP("sft", "pkg.sft:SPEC", ObjectiveSpec(name="sft", build="x:y")),
     "objective 'sft' is registered by both titan-plugins=="),
    (_EP("odd", "pkg.odd:SPEC", object()), "objective entry point from bad-dist==2 is a object"),
    (_EP("named", "pkg.n:SPEC", SPEC), "objective entry point 'named' from bad-dist==2 registers the name 'mine'"),
])
def test_a_broken_objective_package_is_one_line_naming_it(ep, message):
    reg = discover([(ep, "bad-dist==2")])
    assert len(reg.errors) == 1 and message in reg.errors[0] and "\n" not in reg.errors[0]
    assert {"sft", "dpo"} <= set(reg.specs)  # the others stay usable (listing is lenient)
    with pytest.raises(ConfigError, match="objective"):  # a run is strict
        build_objective(OmegaConf.create({"name": "sft"}), reg)


def test_an_unknown_objective_is_one_line_with_a_suggestion():
    with pytest.raises(ConfigError, match=r"objective.name=dpp is not a known objective.*dpo"):
        build_objective(OmegaConf.create({"name": "dpp"}), discover([]))


def test_sft_equals_the_global_token_loss_bit_for_bit():
    torch.manual_seed(0)
    logits = torch.randn(2, 6, 11, requires_grad=True)
    labels = torch.randint(0, 11, (2, 6))
    labels[0, :3] = IGNORE_INDEX
    want_fn = GlobalTokenLoss()
    want_fn.global_tokens = 17.0
    sft = SFTObjective()
    assert sft.count(labels).item() == 9 and sft.pipeline_loss() is not None
    got, sums = sft.loss(logits, labels, scale=17.0)
    assert torch.equal(got, want_fn(logits, labels)) and sums == {}
    record = sft.validation_metrics(2.0, {}, 64.0)
    assert record == {"loss": 2.0, "perplexity": math.exp(2.0), "tokens": 64.0}


def test_dpo_at_equal_policy_and_reference_is_ln2():
    logps = torch.tensor([-3.0, -7.5])
    lengths = torch.tensor([4.0, 9.0])
    for loss_type in ("sigmoid", "robust"):
        losses, r_c, r_r = pair_losses(loss_type, beta=0.1, label_smoothing=0.0, simpo_gamma=0.5,
                                       chosen=logps, rejected=logps.flip(0), chosen_len=lengths,
                                       rejected_len=lengths.flip(0), ref_chosen=logps, ref_rejected=logps.flip(0))
        assert torch.equal(losses, torch.full((2,), math.log(2), dtype=torch.float32))
        assert not r_c.any() and not r_r.any()


def _job(**over):
    job = {"data": {"name": "preference_sample"}, "training": {"local_batch_size": 4}, "parallelism": {"pp": 1}}
    for key, value in over.items():
        group, k = key.split("__")
        job[group][k] = value
    return OmegaConf.create(job)


@pytest.mark.parametrize("over, message", [
    ({"data__name": "builtin"}, "objective.name=dpo trains on preference pairs, but data.name=builtin"),
    ({"training__local_batch_size": 3}, "training.local_batch_size=3 must be even"),
    ({"parallelism__pp": 2}, "parallelism.pp=2: objective.name=dpo needs"),
])
def test_dpo_refuses_what_it_cannot_train_in_one_line(over, message):
    with pytest.raises(ConfigError) as err:
        DPOObjective(SimpleNamespace(loss_type="sigmoid")).check(_job(**over))
    assert message in str(err.value) and "\n" not in str(err.value)


def test_an_unknown_loss_type_is_one_line():
    with pytest.raises(ConfigError, match="objective.loss_type=kto: expected one of sigmoid, ipo"):
        DPOObjective(SimpleNamespace(loss_type="kto"))


def test_reference_free_losses_need_no_reference():
    assert DPOObjective(SimpleNamespace(loss_type="sigmoid")).needs_reference
    assert not DPOObjective(SimpleNamespace(loss_type="simpo")).needs_reference
    assert not DPOObjective(SimpleNamespace(loss_type="orpo")).needs_reference


def test_titan_run_list_shows_the_objectives_and_a_broken_one(monkeypatch, capsys):
    """``titan-run --list`` (and ``--list --json``): the core's objectives, an installed
    one with its distribution, and a broken one as a load error (listing stays lenient)."""
    import json

    from titan_plugins.cli.run import main as run_main
    from titan_plugins.objectives import registry

    installed = [(_EP("mine", "pkg.mod:SPEC", SPEC), "my-dist==1.0"),
                 (_EP("bad", "pkg.bad:SPEC", exc=ImportError("no module named pkg")), "bad-dist==2")]
    monkeypatch.setattr(registry, "_entry_points", lambda: iter(installed))
    assert run_main(["--list"]) == 0
    out = capsys.readouterr().out
    listed = out[out.index("objectives (objective=NAME):"):].splitlines()
    assert listed[1].split()[:3] == ["sft", f"titan-plugins=={__version__}", "[rows]"]
    assert listed[2].split()[:3] == ["dpo", f"titan-plugins=={__version__}", "[pairs]"]
    assert listed[3].split()[:3] == ["grpo", f"titan-plugins=={__version__}", "[prompts]"]
    assert listed[4].split() == ["mine", "my-dist==1.0", "[rows]", "x"]
    assert "objective 'bad' (pkg.bad:SPEC) from bad-dist==2 failed to load: ImportError" in out
    assert run_main(["--list", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [(o["name"], o["origin"], o["data"]) for o in data["objectives"]][3:] == [("mine", "my-dist==1.0", "rows")]
    assert any("objective 'bad'" in e for e in data["errors"])


def test_a_reference_store_finds_rows_by_their_tokens_and_refuses_stale_files(tmp_path):
    """objective.precompute_ref's store: a row's value is found by its tokens and labels
    in any batch order; a row it lacks, or a file made for another start, is one line."""
    from titan_plugins.objectives.precompute import ReferenceStore, first_pass

    inputs = torch.arange(24).reshape(4, 6)
    labels = inputs.clone()
    labels[:, :2] = IGNORE_INDEX
    values = first_pass([(inputs[:2], labels[:2]), (inputs[2:], labels[2:])],
                        lambda x, y: x.float().sum(-1))  # one value per row, as DPO's log-probs
    store = ReferenceStore(tmp_path / "ref.pt", values, computed=True)
    order = torch.tensor([3, 0, 2])
    assert torch.equal(store.lookup(inputs[order], labels[order], torch.device("cpu")),
                       inputs[order].float().sum(-1))
    other = labels[:1].clone()
    other[0, 2] = IGNORE_INDEX  # the same tokens, another completion boundary: another row
    with pytest.raises(ConfigError, match=r"holds no reference value for a row of this batch") as err:
        store.lookup(inputs[:1], other, torch.device("cpu"))
    assert "\n" not in str(err.value)
    store.save({"seed": 0, "data": {"path": "a.jsonl"}})
    again = ReferenceStore.load(tmp_path / "ref.pt", {"seed": 0, "data": {"path": "a.jsonl"}})
    assert not again.computed and all(torch.equal(again.values[k], v) for k, v in values.items())
    with pytest.raises(ConfigError, match=r"ref.pt was computed for another start or data \(data differ\)"):
        ReferenceStore.load(tmp_path / "ref.pt", {"seed": 0, "data": {"path": "b.jsonl"}})
