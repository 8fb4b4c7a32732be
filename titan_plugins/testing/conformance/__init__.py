"""The conformance checks: what a model plugin must satisfy to be a good citizen.

Every check is a plain function of a ``Target`` (a model name, the overrides to
test it with and, optionally, plugin modules to register without installing them)
usable outside pytest too::

    from titan_plugins.testing.conformance import Target, check_meta_build
    check_meta_build(Target("mymodel", overrides=("model.n_layers=2",)))

A check returns ``None`` when the contract holds, a string (the reason) when it
does not apply to this model (e.g. TP is not declared), and raises
``ContractError("<contract>: <what is wrong>. Fix: <how>")`` when it is broken.
Given a ``Session`` (``Session.open(target)``) instead, checks share what they
computed: the composed job, the initialised models, the batched subprocess runs.

One module per kind of contract, by where it runs:

    registration.py  registration, plugin-import (a fresh interpreter)
    schema.py        schema, hydra-compose, typed-override
    build.py         meta-build, init-weights, forward-backward (one process)
    state_dict.py    state-dict;  hf.py: hf-round-trip, hf-transformers;  generation.py: generation
    pipeline.py      pipeline-split (one process, two stages)
    parallelize.py   parallelize-fsdp/tp/ep/pp (one fake-process-group subprocess)
    parity.py        loss-parity fsdp/tp/ep (one launched 2-rank gloo job)

This package imports no torch.
"""

from __future__ import annotations

from titan_plugins.testing.conformance.build import (
    check_forward_backward,
    check_init_weights,
    check_meta_build,
)
from titan_plugins.testing.conformance.contract import (
    CONTRACTS,
    FIXES,
    CheckResult,
    ContractError,
)
from titan_plugins.testing.conformance.generation import check_generation
from titan_plugins.testing.conformance.hf import check_hf_round_trip, check_hf_transformers
from titan_plugins.testing.conformance.parallelize import (
    PARALLELISMS,
    check_parallelize,
    parallelize_configs,
    run_parallelize_checks,
)
from titan_plugins.testing.conformance.parity import (
    PARITY_CASES,
    TRAIN_OVERRIDES,
    check_loss_parity,
    run_parity_checks,
)
from titan_plugins.testing.conformance.pipeline import check_pipeline_split
from titan_plugins.testing.conformance.registration import check_plugin_import, check_registration
from titan_plugins.testing.conformance.schema import (
    check_compose,
    check_schema,
    check_typed_override,
)
from titan_plugins.testing.conformance.session import Initialised, Outcome, Session
from titan_plugins.testing.conformance.state_dict import check_state_dict
from titan_plugins.testing.conformance.target import Target

_FIXES = FIXES  # the name before the kit became a package

__all__ = [
    "CONTRACTS",
    "FIXES",
    "PARALLELISMS",
    "PARITY_CASES",
    "TRAIN_OVERRIDES",
    "CheckResult",
    "ContractError",
    "Initialised",
    "Outcome",
    "Session",
    "Target",
    "check_compose",
    "check_forward_backward",
    "check_generation",
    "check_hf_round_trip",
    "check_hf_transformers",
    "check_init_weights",
    "check_loss_parity",
    "check_meta_build",
    "check_parallelize",
    "check_pipeline_split",
    "check_plugin_import",
    "check_registration",
    "check_schema",
    "check_state_dict",
    "check_typed_override",
    "parallelize_configs",
    "run_parallelize_checks",
    "run_parity_checks",
]
