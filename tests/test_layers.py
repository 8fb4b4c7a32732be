"""The core's layers hold: no import circle between modules of titan_plugins/, and no
import from a lower layer up into a higher one except the few allowed below.

Every ``import`` and ``from ... import`` counts, at module level or inside a function;
``if TYPE_CHECKING:`` blocks do not (they never run). The layers, bottom to top, are
drawn in docs/architecture.md. A new top-level module or package must be given a layer
here (the test names it); a new import that points up or closes a circle fails with
the two modules and the line.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "titan_plugins"

# Bottom to top. A module belongs to the layer of its longest listed prefix.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("base", ("titan_plugins", "titan_plugins.errors", "titan_plugins.spec", "titan_plugins.protocols",
              "titan_plugins.hookspecs", "titan_plugins.suggest", "titan_plugins.failures",
              "titan_plugins.plugin_failures", "titan_plugins.run_dir", "titan_plugins.plugins",
              "titan_plugins.builtin", "titan_plugins.conf")),
    ("config", ("titan_plugins.config", "titan_plugins.peft.config", "titan_plugins.hf.config")),
    ("components", ("titan_plugins.components", "titan_plugins.train.loss", "titan_plugins.train.fused_loss")),
    ("distributed", ("titan_plugins.distributed",)),
    ("data", ("titan_plugins.train.data", "titan_plugins.chat", "titan_plugins.train.special_ids")),
    ("hf mapping", ("titan_plugins.hf.mapping",)),
    ("peft", ("titan_plugins.peft",)),
    ("model", ("titan_plugins.train.lifecycle", "titan_plugins.train.optimizer")),
    ("checkpoint", ("titan_plugins.train.checkpoint", "titan_plugins.peft.checkpoint",
                    "titan_plugins.peft.run_weights", "titan_plugins.hf.load")),
    ("export", ("titan_plugins.export", "titan_plugins.hf.export", "titan_plugins.peft.export",
                "titan_plugins.hf.out_dir")),
    ("objectives", ("titan_plugins.objectives",)),
    ("train", ("titan_plugins.train",)),
    ("apps", ("titan_plugins.hf", "titan_plugins.hf.api", "titan_plugins.generate", "titan_plugins.plan", "titan_plugins.compare")),
    ("cli", ("titan_plugins.cli",)),
    ("testing", ("titan_plugins.testing",)),
]

# (importer, imported): why this one may point up. At most 5.
ALLOWED_UP: dict[tuple[str, str], str] = {
    ("titan_plugins.components.compute_dtype", "titan_plugins.distributed.fsdp"):
        "the dtype-name parser (to_torch_dtype) lives with FSDP's mixed-precision policy",
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}


def layer_of(module: str) -> int:
    best, found = -1, None
    for i, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
                best, found = len(prefix), i
    if found is None or (best == len("titan_plugins") and module != "titan_plugins"):
        raise AssertionError(f"{module} is in no layer: add it to LAYERS in tests/test_layers.py")
    return found


def _type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports(module: str, path: Path) -> list[tuple[str, int]]:
    """``(imported titan_plugins module, line)`` of every import that runs."""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    found: list[tuple[str, int]] = []

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _type_checking(child.test):
                for other in child.orelse:
                    visit_node(other)
                continue
            visit_node(child)

    def visit_node(node: ast.AST) -> None:
        if isinstance(node, ast.Import):
            found.extend((alias.name, node.lineno) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            for alias in node.names:  # a submodule by name, else the module itself
                full = f"{base}.{alias.name}"
                found.append((full if full in MODULES else base, node.lineno))
        visit(node)

    visit(ast.parse(path.read_text(encoding="utf-8")))
    out = []
    for target, line in found:
        while target and target not in MODULES:
            target = target.rpartition(".")[0]
        if target.startswith("titan_plugins") and target != module:
            out.append((target, line))
    return out


def graph() -> dict[str, list[tuple[str, int]]]:
    return {m: imports(m, p) for m, p in sorted(MODULES.items())}


def cycles(edges: dict[str, list[tuple[str, int]]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(edges.get(root, [])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, it = work[-1]
            for target, _ in it:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(edges.get(target, []))))
                    break
                if target in on_stack:
                    low[node] = min(low[node], index[target])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        out.append(sorted(component))
    return out


def upward(edges: dict[str, list[tuple[str, int]]]) -> list[tuple[str, str, int]]:
    out = []
    for module, targets in edges.items():
        for target, line in targets:
            if layer_of(target) > layer_of(module):
                out.append((module, target, line))
    return out


def test_every_module_has_a_layer() -> None:
    for module in MODULES:
        layer_of(module)


def test_no_import_cycles() -> None:
    found = cycles(graph())
    assert not found, f"{len(found)} import cycles: " + "; ".join(" <-> ".join(c) for c in found)


def test_no_upward_imports_beyond_the_allowed() -> None:
    assert len(ALLOWED_UP) <= 5, "the allow-list is for a few exceptions, each with its reason"
    found = upward(graph())
    new = [(m, t, line) for m, t, line in found if (m, t) not in ALLOWED_UP]
    names = [name for name, _ in LAYERS]
    assert not new, f"{len(new)} upward imports: " + "; ".join(
        f"{m}:{line} ({names[layer_of(m)]}) imports {t} ({names[layer_of(t)]})" for m, t, line in new)


def test_the_checks_catch_a_cycle_and_an_upward_import() -> None:
    edges = {"titan_plugins.errors": [("titan_plugins.cli.run", 1)],
             "titan_plugins.cli.run": [("titan_plugins.errors", 2)]}
    assert cycles(edges) == [["titan_plugins.cli.run", "titan_plugins.errors"]]
    assert upward(edges) == [("titan_plugins.errors", "titan_plugins.cli.run", 1)]
