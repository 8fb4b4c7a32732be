"""No module of the core (titan_plugins/) is longer than 500 lines (issue 45): a file that
grows past it holds more than one job and is split by job, not by line count."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "titan_plugins"
MAX_LINES = 500


def too_long(package: Path = PACKAGE, limit: int = MAX_LINES) -> list[tuple[str, int]]:
    """``(path relative to the repository, lines)`` of every ``.py`` file over ``limit``."""
    out = []
    for path in sorted(package.rglob("*.py")):
        lines = len(path.read_text(encoding="utf-8").splitlines())
        if lines > limit:
            out.append((path.relative_to(package.parent).as_posix(), lines))
    return out


def test_no_core_module_over_500_lines() -> None:
    found = too_long()
    assert not found, (f"{len(found)} core modules over {MAX_LINES} lines (split each by job): "
                       + ", ".join(f"{path} ({lines})" for path, lines in found))


def test_the_check_names_a_long_file(tmp_path: Path) -> None:
    package = tmp_path / "titan_plugins"
    (package / "sub").mkdir(parents=True)
    (package / "short.py").write_text("x = 1\n" * MAX_LINES, encoding="utf-8")
    (package / "sub" / "long.py").write_text("x = 1\n" * (MAX_LINES + 1), encoding="utf-8")
    assert too_long(package) == [("titan_plugins/sub/long.py", MAX_LINES + 1)]
