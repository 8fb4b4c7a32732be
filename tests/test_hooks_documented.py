"""Meta-tests (as datasette does): every hook in hookspecs.py is documented in
docs/hooks.md with the spec's signature, and has a ``test_hook_<name>`` test."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

from titan_plugins import hookspecs

ROOT = Path(__file__).resolve().parents[1]
HOOKS = sorted(name for name, obj in vars(hookspecs).items()
               if name.startswith("titan_") and callable(obj))


def test_there_are_hooks() -> None:
    assert "titan_register_models" in HOOKS and len(HOOKS) >= 7


@pytest.mark.parametrize("name", HOOKS)
def test_hook_is_documented_with_its_signature(name: str) -> None:
    docs = (ROOT / "docs" / "hooks.md").read_text()
    params = ", ".join(inspect.signature(getattr(hookspecs, name)).parameters)
    heading = f"### {name}({params})"
    assert heading in docs.splitlines(), f"docs/hooks.md lacks the heading {heading!r}"


def test_no_documented_hook_is_missing_from_the_spec() -> None:
    docs = (ROOT / "docs" / "hooks.md").read_text()
    documented = set(re.findall(r"^### (titan_\w+)\(", docs, flags=re.M))
    assert documented == set(HOOKS)


@pytest.mark.parametrize("name", HOOKS)
def test_hook_has_docstring(name: str) -> None:
    assert (getattr(hookspecs, name).__doc__ or "").strip(), f"{name} has no docstring"


@pytest.mark.parametrize("name", HOOKS)
def test_hook_has_a_test(name: str) -> None:
    pattern = re.compile(rf"^def test_hook_{name}\(", flags=re.M)
    found = [p for p in (ROOT / "tests").rglob("test_*.py") if pattern.search(p.read_text())]
    assert found, f"no test_hook_{name} under tests/"
