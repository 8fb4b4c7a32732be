"""``ConformanceSuite``: the conformance kit as a pytest test class.

    from titan_plugins.testing import ConformanceSuite

    class TestMyModel(ConformanceSuite):
        model_name = "mymodel"
        overrides = ["model.n_layers=2"]

Each contract is its own test, so a failure reads ``test_state_dict FAILED`` with
the contract, what is wrong and how to fix it. Checks that do not apply (TP when
the model does not declare it) are skipped with the reason. The 2-rank training
runs are marked ``titan_slow`` (deselect with ``-m "not titan_slow"``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import pytest

from titan_plugins.testing import conformance as c

__all__ = ["ConformanceSuite"]


def _run(check: Any, *args: Any, **kwargs: Any) -> None:
    try:
        skip = check(*args, **kwargs)
    except c.ContractError as exc:
        pytest.fail(str(exc), pytrace=False)
    if skip:
        pytest.skip(skip)


@pytest.mark.titan_conformance
class ConformanceSuite:
    """Subclass it as ``Test<Something>`` and set ``model_name``.

    Attributes:
        model_name: the registry name (``model=<name>``).
        overrides: Hydra overrides applied to every check (keep the model small).
        plugins: plugin modules to register without installing them.
        ep_overrides: extra overrides for the EP check (e.g. a flavor with experts).
        pp_overrides: extra overrides for the pipeline checks (e.g. untied embeddings).
        persistent_buffers: buffer names that really are state (kept in state_dict).
        parity: which 2-rank gloo runs must match one rank: ``fsdp``, ``tp``.
        train_overrides: the overrides of those short runs.
    """

    model_name: ClassVar[str] = ""
    overrides: ClassVar[Sequence[str]] = ()
    plugins: ClassVar[Sequence[str]] = ()
    ep_overrides: ClassVar[Sequence[str]] = ()
    pp_overrides: ClassVar[Sequence[str]] = ()
    persistent_buffers: ClassVar[Sequence[str]] = ()
    parity: ClassVar[Sequence[str]] = ("fsdp", "tp")
    train_overrides: ClassVar[Sequence[str]] = c.TRAIN_OVERRIDES

    @classmethod
    def titan_target(cls) -> c.Target:
        if not cls.model_name:
            raise pytest.UsageError(f"{cls.__name__}: set model_name = '<your model>'")
        return c.Target(cls.model_name, tuple(cls.overrides), tuple(cls.plugins),
                        tuple(cls.ep_overrides), tuple(cls.pp_overrides))

    # --------------------------------------------------------- registration
    def test_registration(self) -> None:
        _run(c.check_registration, self.titan_target())

    def test_plugin_imports_without_torch(self) -> None:
        _run(c.check_plugin_import, self.titan_target())

    # --------------------------------------------------------------- config
    def test_schema(self) -> None:
        _run(c.check_schema, self.titan_target())

    def test_flavors_compose(self) -> None:
        _run(c.check_compose, self.titan_target())

    def test_typed_override_rejected(self) -> None:
        _run(c.check_typed_override, self.titan_target())

    # --------------------------------------------------------------- module
    def test_meta_build(self) -> None:
        _run(c.check_meta_build, self.titan_target())

    def test_init_weights(self) -> None:
        _run(c.check_init_weights, self.titan_target())

    def test_forward_backward(self) -> None:
        _run(c.check_forward_backward, self.titan_target())

    def test_state_dict(self) -> None:
        _run(c.check_state_dict, self.titan_target(), persistent_buffers=self.persistent_buffers)

    def test_pipeline_split(self) -> None:
        _run(c.check_pipeline_split, self.titan_target())

    def test_hf_round_trip(self) -> None:
        from titan_plugins.testing.hf_check import check_hf_round_trip

        _run(check_hf_round_trip, self.titan_target())

    def test_generation(self) -> None:
        from titan_plugins.testing.generation import check_generation

        _run(check_generation, self.titan_target())

    # ------------------------------------------------- parallelize (fake PG)
    @pytest.mark.parametrize("kind", ["fsdp", "tp", "ep", "pp"])
    def test_parallelize(self, kind: str) -> None:
        _run(c.check_parallelize, self.titan_target(), kind)

    # --------------------------------------------------- loss parity (gloo)
    @pytest.mark.titan_slow
    @pytest.mark.parametrize("kind", ["fsdp", "tp"])
    def test_loss_parity(self, kind: str) -> None:
        if kind not in self.parity:
            pytest.skip(f"{kind} is not in {type(self).__name__}.parity")
        _run(c.check_loss_parity, self.titan_target(), kind, train_overrides=self.train_overrides)
