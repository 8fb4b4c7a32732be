"""``titan-plugins``: what the installed plugins provide.

    titan-plugins list [--json]     every plugin: distribution, hooks, models, config, errors
    titan-plugins show MODEL        one model's schema and flavors

Listing is lenient (a broken plugin is shown with its error, the others still
work) and must stay light: nothing here imports torch.

Subcommands are looked up in ``SUBCOMMANDS``: ``name -> "module:function"``; the
function receives argparse's subparsers object and adds its parser, setting
``func`` (``func(args, pm) -> int``). Another module adds one with one line.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import json
import sys
import typing
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from titan_plugins.cli.errors import main_wrapper
from titan_plugins.spec import ModelSpec, resolve

if TYPE_CHECKING:
    from titan_plugins.plugins import TitanPluginManager

SUBCOMMANDS: dict[str, str] = {
    "list": "titan_plugins.cli.plugins_cmd:add_list_parser",
    "show": "titan_plugins.cli.plugins_cmd:add_show_parser",
    "new": "titan_plugins.cli.scaffold:add_parser",
}


# ---------------------------------------------------------------- gathering
def _hooks_of(pm: TitanPluginManager, plugin: Any) -> list[str]:
    if plugin is None or not pm.is_registered(plugin):
        return []
    return sorted(caller.name for caller in pm.get_hookcallers(plugin) or [])


def _model_entry(spec: ModelSpec) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "name": spec.name,
        "description": spec.description,
        "default_flavor": spec.default_flavor,
        "flavors": None,
        "config": _ref_name(spec.config),
        "capabilities": dataclasses.asdict(spec.capabilities),
        "pipeline": spec.pipeline is not None,
        "error": None,
    }
    try:
        entry["flavors"] = spec.flavor_names()
    except Exception as exc:  # lenient: show the model, say what failed
        entry["error"] = f"flavors: {type(exc).__name__}: {exc}"
    return entry


def _ref_name(ref: Any) -> str:
    if isinstance(ref, str):
        return ref
    return f"{getattr(ref, '__module__', '?')}:{getattr(ref, '__qualname__', repr(ref))}"


def gather(pm: TitanPluginManager) -> dict[str, Any]:
    """Everything ``titan-plugins list --json`` prints."""
    from titan_plugins import API_VERSION, __version__
    from titan_plugins.config.hydra_glue import list_config_options

    pm.models()  # collect: fills each info's models/datasets/search path and errors
    plugins = []
    for info in pm.infos.values():
        groups: dict[str, list[str]] = {}
        for entry in info.searchpath:
            try:
                for group, options in list_config_options(entry).items():
                    groups.setdefault(group, []).extend(options)
            except Exception as exc:
                groups.setdefault("<error>", []).append(f"{entry}: {type(exc).__name__}: {exc}")
        plugins.append({
            "name": info.name,
            "module": info.module,
            "dist": info.dist,
            "version": info.version,
            "builtin": info.builtin,
            "api": info.api,
            "hooks": _hooks_of(pm, info.plugin),
            "models": [_model_entry(spec) for spec in info.model_specs],
            "datasets": [spec.name for spec in info.dataset_specs],
            "searchpath": list(info.searchpath),
            "config_groups": groups,
            "error": info.error,
        })
    from titan_plugins.objectives.registry import discover

    objectives = discover()  # the entry-point group titan_plugins.objectives (and the core's own)
    from titan_plugins.rewards import discover as discover_rewards

    rewards = discover_rewards()  # the entry-point group titan_plugins.rewards (and the core's own)
    return {
        "core": {"dist": "titan-plugins", "version": __version__, "api": API_VERSION},
        "plugins": plugins,
        "objectives": [{"name": spec.name, "origin": objectives.origins[spec.name], "data": spec.data.value,
                        "description": spec.description} for spec in objectives.specs.values()],
        "rewards": [{"name": name, "origin": rewards.origins[name], "description": rewards.descriptions[name]}
                    for name in rewards.refs],
        "errors": list(pm.errors) + objectives.errors + rewards.errors,
    }


# ---------------------------------------------------------------- list
def add_list_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("list", help="list installed plugins and what they provide")
    p.add_argument("--json", action="store_true", help="print JSON (machine-readable)")
    p.add_argument("--all", action="store_true", help="also show the core's built-in plugins")
    p.set_defaults(func=run_list)


def run_list(args: argparse.Namespace, pm: TitanPluginManager) -> int:
    data = gather(pm)
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    core = data["core"]
    out = [f"titan-plugins {core['version']} (plugin API {core['api']})"]
    shown = [p for p in data["plugins"] if args.all or not p["builtin"] or p["error"]]
    if not any(not p["builtin"] for p in data["plugins"]):
        out.append("no plugins installed (pip install a distribution with a 'titan_plugins' entry point)")
    for p in shown:
        status = "FAILED" if p["error"] else "ok"
        out.append("")
        out.append(f"{p['name']}  {p['dist']}=={p['version']}  ({p['module']})  [{status}]")
        if not p["builtin"]:
            out.append(f"  api:      {p['api'] or 'undeclared (no TITAN_PLUGINS_API: any core is assumed to fit)'}")
        if p["hooks"]:
            out.append(f"  hooks:    {', '.join(p['hooks'])}")
        for m in p["models"]:
            if m["flavors"] is None:
                flavors = f"flavors unavailable: {m['error']}"
            else:
                flavors = ", ".join(f + ("*" if f == m["default_flavor"] else "") for f in m["flavors"])
            out.append(f"  model:    {m['name']}  [{flavors}]" + (f"  {m['description']}" if m["description"] else ""))
        if p["datasets"]:
            out.append(f"  datasets: {', '.join(p['datasets'])}")
        for group, options in p["config_groups"].items():
            out.append(f"  config:   {group}: {', '.join(options)}")
        if p["error"]:
            out.append(f"  error:    {p['error']}")
    out.append("")
    out.append("objectives (objective=NAME):")
    out.extend(f"  {o['name']:<10} {o['origin']}  [{o['data']}]  {o['description']}" for o in data["objectives"])
    out.append("")
    out.append("rewards (objective.reward_funcs=[NAME,...]):")
    width = max((len(r["name"]) for r in data["rewards"]), default=0)
    out.extend(f"  {r['name']:<{width}} {r['origin']}  {r['description']}" for r in data["rewards"])
    if data["errors"]:
        out.append("")
        out.append(f"{len(data['errors'])} load error(s):")
        out.extend(f"  {line}" for line in data["errors"])
    print("\n".join(out))
    return 0


# ---------------------------------------------------------------- show
def add_show_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("show", help="show one model's schema and flavors")
    p.add_argument("model", help="a model name, as in model=<name>")
    p.add_argument("--flavor", help="print every value of this flavor (YAML)")
    p.add_argument("--json", action="store_true", help="print JSON (machine-readable)")
    p.set_defaults(func=run_show)


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        inner = " | ".join(_type_name(a) for a in args)
        return f"{inner} | None" if len(args) < len(typing.get_args(tp)) else inner
    if origin is not None:
        args = ", ".join(_type_name(a) for a in typing.get_args(tp))
        return f"{getattr(origin, '__name__', str(origin))}[{args}]"
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return "{" + ", ".join(str(m.value) for m in tp) + "}"
    return getattr(tp, "__name__", str(tp))


def schema_rows(schema: type, prefix: str = "") -> list[tuple[str, str]]:
    """``[(dotted key, type name)]`` for a schema dataclass, nested ones flattened."""
    rows: list[tuple[str, str]] = []
    hints = typing.get_type_hints(schema)
    for f in dataclasses.fields(schema):
        tp = hints.get(f.name, f.type)
        if dataclasses.is_dataclass(tp):
            rows.extend(schema_rows(tp, f"{prefix}{f.name}."))
        else:
            rows.append((f"{prefix}{f.name}", _type_name(tp)))
    return rows


def _value(obj: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        obj = getattr(obj, part, None)
    return obj.value if isinstance(obj, enum.Enum) else obj


def run_show(args: argparse.Namespace, pm: TitanPluginManager) -> int:
    spec = pm.get_model(args.model)  # UnknownModelError: one line, exit 2
    owner = pm.model_owner(args.model)
    schema = resolve(spec.config)
    flavors = spec.load("flavors")
    if args.flavor is not None:
        flavor = spec.flavor(args.flavor)
        from omegaconf import OmegaConf

        print(OmegaConf.to_yaml(OmegaConf.structured(flavor)), end="")
        return 0
    rows = schema_rows(schema)
    if args.json:
        print(json.dumps({
            "name": spec.name,
            "dist": owner.dist,
            "version": owner.version,
            "plugin": owner.name,
            "description": spec.description,
            "schema": _ref_name(spec.config),
            "default_flavor": spec.default_flavor,
            "fields": [{"key": k, "type": t} for k, t in rows],
            "flavors": {name: {k: _value(f, k) for k, _ in rows} for name, f in flavors.items()},
            "capabilities": dataclasses.asdict(spec.capabilities),
        }, indent=2, default=str))
        return 0
    caps = [name for name, on in dataclasses.asdict(spec.capabilities).items() if on]
    out = [
        f"model {spec.name} from {owner.dist}=={owner.version} (plugin {owner.name!r}, {owner.module})",
    ]
    if spec.description:
        out.append(f"  {spec.description}")
    out.append(f"  parallelisms: {', '.join(caps) or 'none'}; pipeline split: "
               f"{'yes' if spec.pipeline is not None else 'no'}")
    out.append(f"  flavors: {', '.join(f + ('*' if f == spec.default_flavor else '') for f in flavors)}"
               f"  (model.flavor=<name>; * is the default)")
    out.append("")
    out.append(f"schema {_ref_name(spec.config)} (override with model.<key>=<value>):")
    names = list(flavors)
    table = [("key", "type", *names)]
    table += [(k, t, *(str(_value(flavors[n], k)) for n in names)) for k, t in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    for row in table:
        out.append("  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
    print("\n".join(out))
    return 0


# ---------------------------------------------------------------- main
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="titan-plugins",
        description="Inspect the installed titan-plugins plugins (entry-point group 'titan_plugins').",
        epilog="Environment: TITAN_PLUGINS_DISABLE_AUTOLOAD=1, TITAN_PLUGINS=a,b (allow-list), "
        "TITAN_PLUGINS_BLOCK=a,b, TITAN_PLUGINS_EXTRA=pkg.module, TITAN_TRACE_PLUGINS=1.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for ref in SUBCOMMANDS.values():
        resolve(ref)(subparsers)
    return parser


@main_wrapper
def _main(argv: Sequence[str] | None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "func", None) is None:
        parser.print_help(sys.stderr)
        return 2
    from titan_plugins.plugins import get_plugin_manager

    pm = get_plugin_manager()  # lenient: errors are shown, not raised
    return args.func(args, pm)


def main(argv: Sequence[str] | None = None) -> int:
    return _main(argv)


if __name__ == "__main__":
    sys.exit(main())
