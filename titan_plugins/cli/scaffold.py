"""``titan-plugins new NAME [--dir PATH]``: write a complete, pip-installable model
plugin (entry point, schema with flavors, a small decoder, a parallelize hook on
the core's helpers, ``hf.py`` mapping config.json and tensor names to transformers'
``LlamaForCausalLM`` (``HFConfigMap``, ``HFMapping``), ``conf/model/NAME.yaml``, a README
and a test running the conformance kit and a load/export against transformers) from
the templates in ``titan_plugins/scaffold_template``.

Template files end in ``.tmpl``; ``{{name}}``, ``{{package}}``, ``{{dist}}`` and
``{{Class}}`` are replaced in their text, ``_package_`` and ``_name_`` in their paths.
"""

from __future__ import annotations

import argparse
import importlib.resources
import keyword
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from titan_plugins.errors import ConfigError

if TYPE_CHECKING:
    from titan_plugins.plugins import TitanPluginManager

__all__ = ["add_parser", "names_for", "run_new", "scaffold"]

TEMPLATE_DIR = "scaffold_template"
_NAME_RE = re.compile(r"^[a-z][a-z0-9_]*$")


def names_for(name: str) -> dict[str, str]:
    """The substitutions for model ``name``: package, distribution and class names."""
    if not _NAME_RE.match(name) or keyword.iskeyword(name) or name.endswith("_"):
        raise ConfigError(
            f"plugin name {name!r} is not valid: use lowercase letters, digits and underscores, "
            "starting with a letter (it becomes model=<name> and the package titan_<name>)"
        )
    return {
        "name": name,
        "package": f"titan_{name}",
        "dist": f"titan-{name.replace('_', '-')}",
        "Class": "".join(part[:1].upper() + part[1:] for part in name.split("_")),
    }


def _render(text: str, names: dict[str, str]) -> str:
    for key, value in names.items():
        text = text.replace("{{" + key + "}}", value)
    return text


def _templates() -> list[tuple[str, str]]:
    """``[(relative path with placeholders, text)]`` of every template file."""
    root = importlib.resources.files("titan_plugins") / TEMPLATE_DIR
    out: list[tuple[str, str]] = []

    def walk(node: Any, prefix: str) -> None:
        for child in sorted(node.iterdir(), key=lambda c: c.name):
            if child.is_dir():
                if child.name != "__pycache__":
                    walk(child, f"{prefix}{child.name}/")
            elif child.name.endswith(".tmpl"):
                out.append((prefix + child.name[: -len(".tmpl")], child.read_text(encoding="utf-8")))

    walk(root, "")
    if not out:
        raise ConfigError(f"the scaffold templates are missing from the installed titan-plugins ({root})")
    return out


def scaffold(name: str, dest: str | Path | None = None) -> tuple[Path, list[Path]]:
    """Write the plugin for model ``name`` into ``dest`` (default ``./titan-<name>``);
    returns the directory and the files written. ``dest`` must not hold files."""
    names = names_for(name)
    target = Path(dest) if dest is not None else Path.cwd() / names["dist"]
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise ConfigError(f"--dir {target}: already exists and is not an empty directory; choose another")
    written: list[Path] = []
    for rel, text in _templates():
        path = target / rel.replace("_package_", names["package"]).replace("_name_", name)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(_render(text, names), encoding="utf-8")
        written.append(path)
    return target, written


# ------------------------------------------------------------------- CLI
def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "new",
        help="write a new model plugin package (scaffold)",
        description="Write a pip-installable model plugin: pyproject with the titan_plugins entry "
        "point, plugin.py, config schema and flavors, a small decoder, a parallelize hook, "
        "hf.py (Hugging Face config and name maps), conf/model/NAME.yaml, a README and a test "
        "running the conformance kit.",
    )
    p.add_argument("name", help="the model name (model=NAME); the package is titan_NAME")
    p.add_argument("--dir", dest="directory", help="where to write it (default: ./titan-NAME); must be new or empty")
    p.set_defaults(func=run_new)


def run_new(args: argparse.Namespace, pm: TitanPluginManager) -> int:
    names = names_for(args.name)
    if pm is not None and args.name in pm.models():
        owner = pm.model_owner(args.name)
        raise ConfigError(
            f"model {args.name!r} is already provided by {owner.dist}=={owner.version}; choose another name"
        )
    target, written = scaffold(args.name, args.directory)
    shown = target if not target.is_absolute() else _relative(target)
    lines = [f"wrote {len(written)} files to {shown}/ (model {names['name']!r}, package "
             f"{names['package']}, distribution {names['dist']})", "", "next:"]
    lines += [
        f"  pip install -e {shown}",
        "  titan-plugins list",
        f"  titan-run model={names['name']} parallelism=fsdp2_tp2 training.steps=3",
        f"  pytest {shown}",
    ]
    print("\n".join(lines))
    return 0


def _relative(path: Path) -> Path:
    try:
        return path.relative_to(Path.cwd())
    except ValueError:
        return path
