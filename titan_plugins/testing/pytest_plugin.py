"""The conformance kit's pytest plugin (entry point ``pytest11``).

It must stay cheap: pytest loads it in every session of every project that has
titan-plugins installed, so nothing heavy is imported at module level. It
registers the kit's markers and shows a broken contract as its one-line message
(``<contract>: <what is wrong>. Fix: <how>``) instead of a traceback.
"""

from __future__ import annotations

import sys
from typing import Any

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "titan_conformance: a titan-plugins conformance check (titan_plugins.testing)"
    )
    config.addinivalue_line(
        "markers", "titan_slow: a conformance check that trains on several gloo ranks (seconds)"
    )


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Any:
    report = yield
    kit = sys.modules.get("titan_plugins.testing.conformance")
    if kit is not None and call.excinfo is not None and report.failed \
            and call.excinfo.errisinstance(kit.ContractError):
        report.longrepr = str(call.excinfo.value)
    return report
