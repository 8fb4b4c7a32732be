"""Tests mirror rooms: a helper that several test files share lives in
``titan_plugins/testing`` (a module with one job) or a ``conftest.py`` (fixtures), never in
a test file that another one imports. Imported, a test module's tests are collected twice
(once under the importer's name), its module fixtures and module-level state are shared
by accident, and moving or deleting a test breaks an unrelated file.

Every ``.py`` file under the test folders (tests/, plugins/*/tests/, examples/*/tests/)
is parsed with ``ast``; an import of a ``test_*`` module (``import test_x``, ``from
test_x import``, ``from tests.test_x import``, ``from .test_x import``) or of a
``conftest`` fails, naming the file and the line. Helper modules that are not tests
(``toy_plugin.py``, ``*_worker.py``, ...) may be imported: the launch machinery loads
some of them as plugins or rank entry points.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TEST_DIRS = [ROOT / "tests", *sorted(ROOT.glob("plugins/*/tests")), *sorted(ROOT.glob("examples/*/tests"))]


def _imported(tree: ast.AST) -> list[tuple[int, str]]:
    """Every module an ``import`` or ``from ... import`` names, at any depth, with its line
    (``from . import test_x`` counts as ``.test_x``)."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = "." * node.level + (node.module or "")
            out.append((node.lineno, base))
            if not node.module:  # from . import test_x
                out += [(node.lineno, base + alias.name) for alias in node.names]
    return out


def _is_test_module(name: str) -> bool:
    parts = [p for p in name.split(".") if p]
    return any(p.startswith("test_") or p == "conftest" for p in parts)


def offenders(dirs: list[Path], root: Path = ROOT) -> list[str]:
    """``path:line imports name`` for every import of a test module under ``dirs``."""
    found = []
    for folder in dirs:
        for path in sorted(folder.rglob("*.py")):
            tree = ast.parse(path.read_text(), filename=str(path))
            found += [f"{path.relative_to(root)}:{line} imports {name}"
                      for line, name in _imported(tree) if _is_test_module(name)]
    return found


def test_no_test_file_imports_another_test_module() -> None:
    found = offenders(TEST_DIRS)
    assert not found, ("a test file imports another test module; move the shared helper to "
                       "titan_plugins/testing/ (a module with one job) or a conftest.py fixture:\n  "
                       + "\n  ".join(found))


def test_the_check_sees_every_form(tmp_path) -> None:
    (tmp_path / "test_a.py").write_text("X = 1\n")
    (tmp_path / "test_b.py").write_text(
        "import os\nfrom test_a import X\n\n\ndef test_b():\n    from tests.test_a import X\n"
        "    from . import test_a\n    from .test_a import X\n    import conftest\n"
        "    from titan_plugins.testing import gloo\n    import token_layouts\n")
    (tmp_path / "helper.py").write_text("import test_a as a\n")
    assert offenders([tmp_path], tmp_path) == [
        "helper.py:1 imports test_a",
        "test_b.py:2 imports test_a", "test_b.py:6 imports tests.test_a", "test_b.py:7 imports .test_a",
        "test_b.py:8 imports .test_a", "test_b.py:9 imports conftest",
    ]
