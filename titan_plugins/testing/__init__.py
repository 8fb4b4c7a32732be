"""The conformance kit for plugin authors.

In a pytest file::

    from titan_plugins.testing import ConformanceSuite

    class TestMyModel(ConformanceSuite):
        model_name = "mymodel"
        overrides = ["model.n_layers=2"]

Outside pytest, every check is a plain function of a ``Target`` raising
``ContractError`` (see ``titan_plugins.testing.conformance``). Importing this
package imports no torch; ``ConformanceSuite`` (which needs pytest) loads on use.
"""

from __future__ import annotations

from typing import Any

from titan_plugins.testing.conformance import CONTRACTS, ContractError, Target

__all__ = ["CONTRACTS", "ConformanceSuite", "ContractError", "Target"]


def __getattr__(name: str) -> Any:
    if name == "ConformanceSuite":
        from titan_plugins.testing.suite import ConformanceSuite

        return ConformanceSuite
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
