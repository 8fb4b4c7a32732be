"""``ConformanceSuite``: the conformance kit as a pytest test class.

    from titan_plugins.testing import ConformanceSuite

    class TestMyModel(ConformanceSuite):
        model_name = "mymodel"
        overrides = ["model.n_layers=2"]

Each contract is its own test, so a failure reads ``test_state_dict FAILED`` with
the contract, what is wrong and how to fix it. Checks that do not apply (TP when
the model does not declare it) are skipped with the reason. The 2-rank training
runs are marked ``titan_slow`` (deselect with ``-m "not titan_slow"``).

The tests of one class share one ``Session`` (a class-scoped fixture): the composed
job, the initialised models, one fake-process-group subprocess for every
parallelize case and one launched 2-rank job for every parity case.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator, Sequence
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
        parity: which 2-rank gloo runs must match one rank: ``fsdp``, ``tp``, ``ep``,
            ``cp`` (context parallel: the sequence split over the 2 ranks), run together
            in one launched job; a case the model does not declare skips, saying so.
        train_overrides: the overrides of those short runs.
    """

    model_name: ClassVar[str] = ""
    overrides: ClassVar[Sequence[str]] = ()
    plugins: ClassVar[Sequence[str]] = ()
    ep_overrides: ClassVar[Sequence[str]] = ()
    pp_overrides: ClassVar[Sequence[str]] = ()
    persistent_buffers: ClassVar[Sequence[str]] = ()
    parity: ClassVar[Sequence[str]] = ("fsdp", "tp", "ep", "cp")
    train_overrides: ClassVar[Sequence[str]] = c.TRAIN_OVERRIDES

    @classmethod
    def titan_target(cls) -> c.Target:
        if not cls.model_name:
            raise pytest.UsageError(f"{cls.__name__}: set model_name = '<your model>'")
        return c.Target(cls.model_name, tuple(cls.overrides), tuple(cls.plugins),
                        tuple(cls.ep_overrides), tuple(cls.pp_overrides))

    @pytest.fixture(scope="class")
    @classmethod
    def titan_session(cls) -> Iterator[c.Session | c.Target]:
        """What this class's checks share, dropped after the class. When the model
        cannot be found, the bare target: each check then fails with that error."""
        target = cls.titan_target()
        try:
            session: c.Session | c.Target = c.Session.open(target)
        except c.ContractError:
            session = target
        yield session
        # The parity runs' directory goes unless a failure message points into it.
        if isinstance(session, c.Session) and session.workdir and \
                not any(isinstance(o, c.ContractError) for o in session.outcomes.values()):
            shutil.rmtree(session.workdir, ignore_errors=True)

    # --------------------------------------------------------- registration
    def test_registration(self, titan_session: c.Session | c.Target) -> None:
        _run(c.check_registration, titan_session)

    def test_plugin_imports_without_torch(self, titan_session: c.Session | c.Target) -> None:
        _run(c.check_plugin_import, titan_session)

    # --------------------------------------------------------------- config
    def test_schema(self, titan_session: c.Session | c.Target) -> None:
        _run(c.check_schema, titan_session)

    def test_flavors_compose(self, titan_session: c.Session | c.Target) -> None:
        _run(c.check_compose, titan_session)

    def test_typed_override_rejected(self, titan_session: c.Session | c.Target) -> None:
        _run(c.check_typed_override, titan_session)

    # --------------------------------------------------------------- module
    def test_meta_build(self, titan_session: c.Session | c.Target) -> None:
        _run(c.check_meta_build, titan_session)

    def test_init_weights(self, titan_session: c.Session | c.Target) -> None:
        _run(c.check_init_weights, titan_session)

    def test_forward_backward(self, titan_session: c.Session | c.Target) -> None:
        _run(c.check_forward_backward, titan_session)

    def test_state_dict(self, titan_session: c.Session | c.Target) -> None:
        _run(c.check_state_dict, titan_session, persistent_buffers=self.persistent_buffers)

    def test_pipeline_split(self, titan_session: c.Session | c.Target) -> None:
        _run(c.check_pipeline_split, titan_session)

    def test_hf_round_trip(self, titan_session: c.Session | c.Target) -> None:
        _run(c.check_hf_round_trip, titan_session)

    def test_hf_transformers(self, titan_session: c.Session | c.Target) -> None:
        _run(c.check_hf_transformers, titan_session)

    def test_generation(self, titan_session: c.Session | c.Target) -> None:
        _run(c.check_generation, titan_session)

    # ------------------------------------------------- parallelize (fake PG)
    @pytest.mark.parametrize("kind", ["fsdp", "tp", "ep", "pp"])
    def test_parallelize(self, titan_session: c.Session | c.Target, kind: str) -> None:
        _run(c.check_parallelize, titan_session, kind)

    # --------------------------------------------------- loss parity (gloo)
    @pytest.mark.titan_slow
    @pytest.mark.parametrize("kind", ["fsdp", "tp", "ep", "cp"])
    def test_loss_parity(self, titan_session: c.Session | c.Target, kind: str) -> None:
        if kind not in self.parity:
            pytest.skip(f"{kind} is not in {type(self).__name__}.parity")
        _run(c.check_loss_parity, titan_session, kind, train_overrides=self.train_overrides,
             together=self.parity)
