"""``titan-run --help``: usage, the config groups with their options, and the
models the installed plugins provide (with flavors and providing distribution).

Built from the plugin manager, so a newly installed plugin shows up with no
edit to the core. Imports no torch.
"""

from __future__ import annotations

import textwrap
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from titan_plugins.plugins import TitanPluginManager

USAGE = """\
usage: titan-run [OVERRIDE ...] [-m] [--cfg job] [--info searchpath] [--help]

Compose a training job with Hydra (groups and key=value overrides), check it
against the model's schema and the parallelism, then launch the ranks.

  titan-run model=deepseek_v3 parallelism=fsdp4_tp2_ep2
  titan-run model=qwen3 model.flavor=debugmodel model.n_layers=4 training.steps=20
  titan-run -m model=qwen3,llama4 parallelism=fsdp2,fsdp2_tp2 precision=fp32,bf16_mixed
  titan-run model=llama4 parallelism=fsdp2_tp2_ep2_pp2 plan=true   (print the plan, run nothing)

  -m, --multirun      sweep over comma-separated values (one job per combination)
  --cfg job           print the composed config and exit
  --info searchpath   print Hydra's config search path, with the distribution of each entry
  group=option        choose a config group option (below); key=value sets one value
"""

_GROUP_ORDER = ("model", "parallelism", "precision", "training", "data", "checkpoint", "metrics")


def _wrap(items: list[str], indent: int, width: int = 100) -> str:
    text = ", ".join(items)
    lines = textwrap.wrap(text, width=width - indent, break_on_hyphens=False) or [""]
    pad = " " * indent
    return lines[0] + "".join(f"\n{pad}{line}" for line in lines[1:])


def primary_defaults() -> dict[str, str]:
    """``{group: default option}`` from the defaults list of conf/train.yaml."""
    import importlib.resources

    import yaml

    from titan_plugins.config.hydra_glue import CONFIG_MODULE, PRIMARY_CONFIG

    text = importlib.resources.files(CONFIG_MODULE).joinpath(f"{PRIMARY_CONFIG}.yaml").read_text()
    out: dict[str, str] = {}
    for item in yaml.safe_load(text).get("defaults", []):
        if isinstance(item, dict):
            out.update({str(group): str(option) for group, option in item.items()})
    return out


def format_help(pm: TitanPluginManager) -> str:
    """The text of ``titan-run --help`` for the plugins ``pm`` has loaded."""
    from titan_plugins.config.hydra_glue import config_options
    from titan_plugins.config.schema import JobConfig

    out = [USAGE]
    options = config_options(pm)
    defaults = primary_defaults()
    groups = [g for g in _GROUP_ORDER if g in options] + sorted(set(options) - set(_GROUP_ORDER))
    out.append("config groups (group=option; default marked *):")
    width = max((len(g) for g in groups), default=5) + 2
    for group in groups:
        names = [n + ("*" if defaults.get(group) == n else "") for n in options[group]]
        out.append(f"  {group.ljust(width)}{_wrap(names, indent=2 + width)}")
    import dataclasses

    keys = [f.name for f in dataclasses.fields(JobConfig) if f.name not in ("model", "run_dir")]
    out.append(f"  (every key of {', '.join(keys)} can be set: training.steps=20; "
               "see --cfg job)")
    out.append("")
    models = pm.models()
    if models:
        out.append("installed models (model=<name>, model.flavor=<flavor>; default flavor marked *):")
        width = max(len(n) for n in models) + 2
        for name in sorted(models):
            spec = models[name]
            owner = pm.model_owner(name)
            try:
                flavors = [f + ("*" if f == spec.default_flavor else "") for f in spec.flavor_names()]
            except Exception as exc:
                flavors = [f"<flavors unavailable: {type(exc).__name__}>"]
            out.append(f"  {name.ljust(width)}from {owner.dist}=={owner.version}")
            out.append(f"  {' ' * width}flavors: {_wrap(flavors, indent=2 + width + 9)}")
        out.append("  (`titan-plugins show NAME` prints a model's schema and flavors)")
    else:
        out.append("installed models: none. Install a model plugin distribution (one with a "
                   "'titan_plugins' entry point) into this environment with pip, or start one with "
                   "`titan-plugins new NAME` (see `titan-plugins list`).")
    if pm.errors:
        out.append("")
        out.append("plugin load errors (titan-run refuses to start until they are fixed):")
        out.extend(f"  {line}" for line in pm.errors)
    return "\n".join(out) + "\n"


_INFO = ("--info", "-i")
_INFO_WITHOUT_JOB = ("searchpath", "plugins")  # what Hydra prints does not depend on the job


def info_argv(argv: list[str], overrides: list[str], pm: TitanPluginManager) -> list[str]:
    """``titan-run --info TOPIC``: Hydra composes the job even for the search path, and
    the job has no default model, so ``--info searchpath`` alone ended in a traceback.
    For the topics that do not depend on the job, any installed model stands in; the
    others need ``model=NAME`` (one line, like a run)."""
    from titan_plugins.errors import ConfigError

    if not any(a in _INFO for a in argv) or any(o.lstrip("+").startswith("model=") for o in overrides):
        return argv
    index = max(i for i, a in enumerate(argv) if a in _INFO)
    topic = argv[index + 1] if index + 1 < len(argv) and not argv[index + 1].startswith("-") else "all"
    models = sorted(pm.models())
    if topic not in _INFO_WITHOUT_JOB:
        choices = ", ".join(models) or "none installed"
        raise ConfigError(f"--info {topic} shows a composed job: give model=NAME (one of: {choices})")
    if not models:
        raise ConfigError(f"--info {topic}: no model plugin is installed (see `titan-plugins list`)")
    return [*argv, f"model={models[0]}"]
