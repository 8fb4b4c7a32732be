"""``titan-plugins new NAME [--dir PATH] [--objective]``: write a complete, pip-installable model
plugin (entry point, schema with flavors, a small decoder, a parallelize hook on
the core's helpers, ``hf.py`` mapping config.json and tensor names to transformers'
``LlamaForCausalLM`` (``HFConfigMap``, ``HFMapping``), ``conf/model/NAME.yaml``, a README
and a test running the conformance kit and a load/export against transformers) from
the templates in ``titan_plugins/scaffold_template``.

With ``--objective``: a training-objective package instead (the entry-point group
``titan_plugins.objectives``, an ``ObjectiveSpec``, an ``Objective`` subclass, a README
and its tests; modelled on ``examples/seq_mean_objective``) from
``scaffold_template/objective``.

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
KINDS = ("model", "objective")
OBJECTIVE_DIR = "objective"  # the objective's templates; the model's are the rest of TEMPLATE_DIR
_NAME_RE = re.compile(r"^[a-z][a-z0-9_]*$")


def names_for(name: str, kind: str = "model") -> dict[str, str]:
    """The substitutions for model (or objective) ``name``: package, distribution and class names."""
    if not _NAME_RE.match(name) or keyword.iskeyword(name) or name.endswith("_"):
        raise ConfigError(
            f"plugin name {name!r} is not valid: use lowercase letters, digits and underscores, "
            f"starting with a letter (it becomes {kind}=<name> and the package titan_<name>)"
        )
    dist = f"titan-{name.replace('_', '-')}"
    return {
        "name": name,
        "package": f"titan_{name}",
        "dist": dist if kind == "model" else f"{dist}-objective",
        "Class": "".join(part[:1].upper() + part[1:] for part in name.split("_")),
    }


def api_range() -> str:
    """The plugin API range a package generated now declares: this core's minor up to
    the next major (docs/writing-a-plugin.md, the compatibility promise)."""
    from titan_plugins import API_VERSION

    major = int(API_VERSION.split(".")[0])
    return f">={API_VERSION},<{major + 1}"


def _render(text: str, names: dict[str, str]) -> str:
    for key, value in names.items():
        text = text.replace("{{" + key + "}}", value)
    return text


def _templates(kind: str = "model") -> list[tuple[str, str]]:
    """``[(relative path with placeholders, text)]`` of every template file of ``kind``."""
    root = importlib.resources.files("titan_plugins") / TEMPLATE_DIR
    if kind == "objective":
        root = root / OBJECTIVE_DIR
    out: list[tuple[str, str]] = []

    def walk(node: Any, prefix: str) -> None:
        for child in sorted(node.iterdir(), key=lambda c: c.name):
            if child.is_dir():
                if child.name != "__pycache__" and not (kind == "model" and not prefix and child.name == OBJECTIVE_DIR):
                    walk(child, f"{prefix}{child.name}/")
            elif child.name.endswith(".tmpl"):
                out.append((prefix + child.name[: -len(".tmpl")], child.read_text(encoding="utf-8")))

    walk(root, "")
    if not out:
        raise ConfigError(f"the scaffold templates are missing from the installed titan-plugins ({root})")
    return out


def scaffold(name: str, dest: str | Path | None = None, kind: str = "model") -> tuple[Path, list[Path]]:
    """Write the plugin for model ``name`` (``kind="objective"``: the objective package)
    into ``dest`` (default ``./<distribution name>``); returns the directory and the
    files written. ``dest`` must not hold files."""
    if kind not in KINDS:
        raise ValueError(f"kind={kind!r}: expected one of {KINDS}")
    names = names_for(name, kind)
    target = Path(dest) if dest is not None else Path.cwd() / names["dist"]
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise ConfigError(f"--dir {target}: already exists and is not an empty directory; choose another")
    written: list[Path] = []
    for rel, text in _templates(kind):
        path = target / rel.replace("_package_", names["package"]).replace("_name_", name)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(_render(text, {**names, "api_range": api_range()}), encoding="utf-8")
        written.append(path)
    return target, written


# ------------------------------------------------------------------- CLI
def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "new",
        help="write a new model plugin (or, with --objective, objective) package (scaffold)",
        description="Write a pip-installable model plugin: pyproject with the titan_plugins entry "
        "point, plugin.py, config schema and flavors, a small decoder, a parallelize hook, "
        "hf.py (Hugging Face config and name maps), conf/model/NAME.yaml, a README and a test "
        "running the conformance kit. With --objective: a training objective package instead "
        "(the titan_plugins.objectives entry point, its ObjectiveSpec and Objective, a README, tests).",
    )
    p.add_argument("name", help="the model name (model=NAME) or objective name (objective.name=NAME); "
                   "the package is titan_NAME")
    p.add_argument("--objective", action="store_true",
                   help="write an objective package (default: ./titan-NAME-objective)")
    p.add_argument("--dir", dest="directory", help="where to write it (default: ./titan-NAME); must be new or empty")
    p.set_defaults(func=run_new)


def run_new(args: argparse.Namespace, pm: TitanPluginManager) -> int:
    kind = "objective" if getattr(args, "objective", False) else "model"
    names = names_for(args.name, kind)
    _refuse_taken(kind, args.name, pm)
    target, written = scaffold(args.name, args.directory, kind)
    shown = target if not target.is_absolute() else _relative(target)
    train = (f"titan-run model={names['name']} parallelism=fsdp2_tp2 training.steps=3" if kind == "model" else
             f"titan-run model=qwen3 data=chat_sample objective.name={names['name']} training.steps=3")
    lines = [f"wrote {len(written)} files to {shown}/ ({kind} {names['name']!r}, package "
             f"{names['package']}, distribution {names['dist']})", "", "next:",
             f"  pip install -e {shown}", "  titan-plugins list", f"  {train}", f"  pytest {shown}"]
    print("\n".join(lines))
    return 0


def _refuse_taken(kind: str, name: str, pm: TitanPluginManager | None) -> None:
    """A name an installed plugin already provides, in one line naming its distribution."""
    if kind == "model":
        if pm is not None and name in pm.models():
            owner = pm.model_owner(name)
            raise ConfigError(f"model {name!r} is already provided by {owner.dist}=={owner.version}; "
                              "choose another name")
        return
    from titan_plugins.objectives.registry import discover

    installed = discover()
    if name in installed.specs:
        raise ConfigError(f"objective {name!r} is already provided by {installed.origins[name]}; "
                          "choose another name")


def _relative(path: Path) -> Path:
    try:
        return path.relative_to(Path.cwd())
    except ValueError:
        return path
