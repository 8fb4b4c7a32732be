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

# Bottom to top: the rooms (top-level folders and modules of titan_plugins/) on each layer.
# A room's modules sit on its layer; docs/architecture.md draws the same picture.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("base", ("__init__", "_moved", "errors", "spec", "protocols", "hookspecs", "suggest", "failures",
              "plugin_failures", "run_dir", "plugins", "_discovery", "_registrations", "builtin", "conf")),
    ("config", ("config",)),
    ("components", ("components",)),
    ("loss", ("loss",)),
    ("distributed", ("distributed",)),
    ("data", ("data", "chat")),
    ("hf mapping", ()),
    ("peft", ("peft",)),
    ("model", ("model",)),
    ("checkpoint", ("checkpoint",)),
    ("export", ("export",)),
    ("objectives", ("objectives", "rewards")),
    ("train", ("train",)),
    ("apps", ("hf", "generate", "plan", "compare")),
    ("cli", ("cli",)),
    ("testing", ("testing",)),
]

# Modules that sit on another layer than their room's, each with its reason. The Hugging Face and
# PEFT rooms keep one format's code together although it serves several layers.
SPLIT: dict[str, tuple[str, str]] = {
    "titan_plugins.hf.config": ("config", "config.json read into a plugin's config"),
    "titan_plugins.peft.config": ("config", "the peft.* schema"),
    "titan_plugins.hf.mapping": ("hf mapping", "a plugin's declared Hugging Face names, used by peft and load"),
    "titan_plugins.hf.mapping_entries": ("hf mapping", "the entries and transforms hf.mapping is declared with"),
    "titan_plugins.hf.load": ("checkpoint", "a folder's weights into the built model"),
    "titan_plugins.peft.checkpoint": ("checkpoint", "adapter-only checkpoints"),
    "titan_plugins.peft.run_weights": ("checkpoint", "a LoRA run's weights read back"),
    "titan_plugins.hf.export": ("export", "the old import path of export/ (re-exports)"),
    "titan_plugins.hf.out_dir": ("export", "the old import path of export/out_dir (re-exports)"),
    "titan_plugins.peft.export": ("export", "the PEFT adapter folder writer"),
}

# (importer, imported): why this one may point up. At most 5.
ALLOWED_UP: dict[tuple[str, str], str] = {
    ("titan_plugins.components.compute_dtype", "titan_plugins.distributed.fsdp"):
        "the dtype-name parser (to_torch_dtype) lives with FSDP's mixed-precision policy",
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}


def room_of(module: str) -> str:
    """``titan_plugins.data.sources`` -> ``data``; the package itself -> ``__init__``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


ROOM_LAYER = {room: i for i, (_, rooms) in enumerate(LAYERS) for room in rooms}
LAYER_INDEX = {name: i for i, (name, _) in enumerate(LAYERS)}


def layer_of(module: str) -> int:
    if module in SPLIT:
        return LAYER_INDEX[SPLIT[module][0]]
    room = room_of(module)
    if room not in ROOM_LAYER:
        raise AssertionError(f"room {room!r} ({module}) is in no layer: add it to LAYERS in tests/test_layers.py")
    return ROOM_LAYER[room]


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


def test_every_room_has_a_layer_and_exists() -> None:
    rooms = {p.stem if p.suffix == ".py" else p.name for p in PACKAGE.iterdir()
             if (p.suffix == ".py" or (p.is_dir() and (p / "__init__.py").exists()))}
    rooms.add("__init__")
    assert rooms == set(ROOM_LAYER), (f"rooms without a layer: {sorted(rooms - set(ROOM_LAYER))}; "
                                      f"layers naming no room: {sorted(set(ROOM_LAYER) - rooms)}")
    assert all(module in MODULES for module in SPLIT), [m for m in SPLIT if m not in MODULES]


def test_split_modules_are_few_and_off_their_rooms_layer() -> None:
    """A module listed in SPLIT is there because it serves another layer than its room's."""
    assert len(SPLIT) <= 10, "splitting a room is the exception; move the module to its layer's room"
    for module, (layer, reason) in SPLIT.items():
        assert reason and LAYER_INDEX[layer] != ROOM_LAYER[room_of(module)], module


def test_the_architecture_picture_names_every_room() -> None:
    picture = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    drawn = picture[picture.index("```"):picture.index("```", picture.index("```") + 3)]
    rooms = {room for room in ROOM_LAYER if not room.startswith("_")}
    missing = sorted(room for room in rooms if f"{room}/" not in drawn and room not in drawn)
    assert not missing, f"docs/architecture.md's picture lacks the rooms {missing}"


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
