"""Read a Hugging Face model folder's config.json and map it through the plugin.

Runs in the launcher (``resolve_model``), so every error here is one line before
any rank starts.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from dataclasses import field as dataclass_field
from pathlib import Path
from typing import Any

from titan_plugins.errors import ConfigError
from titan_plugins.spec import ModelSpec

__all__ = [
    "rope_from_hf",
    "NO_EFFECT", "Field", "FolderTokens", "HFConfigMap", "check_partial", "hf_model_values", "refuse_dropped",
    "read_hf_config", "tokenizer_path", "yaml_defaults",
]


def read_hf_config(path: str | Path, key: str = "model.hf") -> dict[str, Any]:
    """The parsed ``config.json`` of a local model folder; ConfigError otherwise."""
    folder = Path(path)
    if not folder.is_dir():
        raise ConfigError(f"{key}={path}: no such folder")
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise ConfigError(f"{key}={path}: the folder has no config.json")
    try:
        data = json.loads(config_file.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{key}={path}: config.json does not parse ({exc})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{key}={path}: config.json is not a JSON object")
    if not any(folder.glob("*.safetensors")):
        raise ConfigError(f"{key}={path}: the folder has no *.safetensors weights")
    return data


def hf_model_values(spec: ModelSpec, path: str | Path) -> dict[str, Any]:
    """Values for the plugin's config schema from the folder's config.json."""
    mapper = spec.load("config_from_hf")
    if mapper is None:
        raise ConfigError(
            f"model.hf={path}: model {spec.name!r} cannot load Hugging Face folders "
            "(its plugin has no config_from_hf)"
        )
    if spec.load("state_dict_adapter") is None or not hasattr(spec.load("state_dict_adapter"), "from_hf"):
        raise ConfigError(f"model.hf={path}: model {spec.name!r} has no state-dict adapter with from_hf")
    hf_config = read_hf_config(path)
    try:
        values = mapper(hf_config)
    except ConfigError as exc:
        raise ConfigError(f"model.hf={path}: {exc}") from None
    return dict(values)


def tokenizer_path(folder: str | Path) -> Path | None:
    """The folder's tokenizer.json, if it has one."""
    candidate = Path(folder) / "tokenizer.json"
    return candidate if candidate.is_file() else None


# --------------------------------------------------------------- launch checks
_LAYER_KEYS = ("n_layers", "n_layer", "num_layers")


def yaml_defaults(model_node: Any, user: dict[str, Any], values: dict[str, Any]) -> dict[str, Any]:
    """``user`` without the model YAML's interpolated defaults that config.json sets.

    A model YAML may default a field from the job (``max_seq_len: ${training.seq_len}``,
    TorchTitan's ``update_from_config``); with ``model.hf`` the folder's value wins
    unless the user set the key (an override replaces the interpolation by a value)."""
    from omegaconf import DictConfig, OmegaConf

    if not isinstance(model_node, DictConfig):
        return user
    out = dict(user)
    for key in list(out):
        if key in values and key in model_node and OmegaConf.is_interpolation(model_node, key):
            del out[key]
    return out


def check_partial(path: str | Path, values: dict[str, Any], user: dict[str, Any], partial: bool) -> None:
    """An override that loads only a part of the folder (fewer layers than config.json's)
    is an error unless ``model.hf_partial=true`` asks for it."""
    if partial:
        return
    for key in _LAYER_KEYS:
        folder_n, ours = values.get(key), user.get(key)
        if isinstance(folder_n, int) and isinstance(ours, int) and ours < folder_n:
            raise ConfigError(
                f"model.{key}={ours}: model.hf={path} has {folder_n} layers; loading only the first "
                f"{ours} drops the rest (add model.hf_partial=true to do that on purpose)"
            )


# ------------------------------------------------------------ the field mapping
#: config.json fields that change nothing a loaded model computes (bookkeeping,
#: generation and initialisation settings); every plugin's mapping starts from these.
NO_EFFECT = frozenset({
    "architectures", "model_type", "transformers_version", "dtype", "torch_dtype", "_name_or_path",
    "output_hidden_states", "output_attentions", "return_dict", "chunk_size_feed_forward",
    "is_encoder_decoder", "id2label", "label2id", "problem_type", "use_cache", "initializer_range",
    "pad_token_id", "bos_token_id", "eos_token_id", "tokenizer_class", "prefix", "sep_token_id",
    "decoder_start_token_id", "task_specific_params", "finetuning_task", "tie_encoder_decoder",
    "_attn_implementation", "_attn_implementation_autoset",
})


@dataclass(frozen=True)
class Field:
    """One config.json field mapped to one field of the plugin's config.

    ``ours`` is a dotted path (``moe.num_experts`` for a nested dataclass); ``cast``
    converts config.json's value (``int``, ``float``, ``bool``, ``str``); ``to_hf``
    (optional) converts ours back where the two differ."""

    hf: str
    ours: str
    cast: Callable[[Any], Any] = int
    to_hf: Callable[[Any], Any] | None = None


def _get(obj: Any, path: str) -> Any:
    for part in path.split("."):
        obj = obj[part] if isinstance(obj, dict) else getattr(obj, part)
    return getattr(obj, "value", obj)  # Enums as their values


def _put(tree: dict[str, Any], path: str, value: Any) -> None:
    *parents, leaf = path.split(".")
    for part in parents:
        tree = tree.setdefault(part, {})
    tree[leaf] = value


class HFConfigMap:
    """The config.json <-> plugin config mapping most plugins share, declared once.

    ``fields`` map both ways; ``fixed`` fields must hold the one value the model
    implements (absent or null is fine; written back on export); ``no_effect`` adds to
    :data:`NO_EFFECT`; ``hf_defaults`` are transformers' values for absent fields. What a
    declaration cannot say (RoPE variants, derived sizes) the plugin maps by hand and
    reports through ``used``; :meth:`finish` then refuses every field nobody mapped::

        MAP = HFConfigMap("qwen3", fields=[Field("hidden_size", "dim"), ...],
                          fixed={"hidden_act": "silu"})

        def config_from_hf(hf):
            out, used = MAP.read(hf)
            ...  # hand-mapped fields: used.add("rope_parameters"); out["rope_theta"] = ...
            return MAP.finish(hf, used, out)

        def config_to_hf(config):
            return {**MAP.write(config), ...}
    """

    def __init__(
        self,
        plugin: str,
        *,
        fields: Iterable[Field] = (),
        fixed: dict[str, Any] | None = None,
        no_effect: Iterable[str] = (),
        hf_defaults: dict[str, Any] | None = None,
    ) -> None:
        self.plugin = plugin
        self.fields = tuple(fields)
        self.fixed = dict(fixed or {})
        self.no_effect = NO_EFFECT | frozenset(no_effect)
        self.hf_defaults = dict(hf_defaults or {})

    def bad(self, field: str, value: Any, why: str) -> ConfigError:
        """The one-line error for a config.json field: ``config.json: FIELD=VALUE: why``."""
        return ConfigError(f"config.json: {field}={value!r}: {why}")

    def read(self, hf: dict[str, Any]) -> tuple[dict[str, Any], set[str]]:
        """``(values for the plugin's config, the config.json fields consumed)``; a fixed
        field holding another value is an error."""
        hf = {**self.hf_defaults, **hf}
        for field, value in self.fixed.items():
            if hf.get(field) is not None and hf[field] != value:
                raise self.bad(field, hf[field], f"the {self.plugin} plugin implements only {value!r}")
        out: dict[str, Any] = {}
        used = set(self.no_effect) | set(self.fixed)
        for f in self.fields:
            used.add(f.hf)
            value = hf.get(f.hf)
            if value is None:
                continue
            if f.cast is int and (isinstance(value, bool) or not isinstance(value, int | float)
                                  or int(value) != value):
                raise self.bad(f.hf, value, "must be an integer")
            _put(out, f.ours, f.cast(value))
        return out, used

    def finish(self, hf: dict[str, Any], used: set[str], out: dict[str, Any]) -> dict[str, Any]:
        """``out``, after refusing any config.json field neither declared nor hand-mapped."""
        unknown = sorted(set(hf) - used)
        if unknown:
            raise self.bad(unknown[0], hf[unknown[0]], f"not understood by the {self.plugin} plugin "
                           "(it would be dropped)")
        return out

    def write(self, config: Any) -> dict[str, Any]:
        """The declared fields (and the fixed ones) of a config.json for ``config``."""
        out: dict[str, Any] = {}
        for f in self.fields:
            value = _get(config, f.ours)
            out[f.hf] = f.to_hf(value) if f.to_hf else value
        out.update(self.fixed)
        return out


# ------------------------------------------------------- what goes beside config.json
@dataclass
class FolderTokens:
    """Special-token ids (and the weights' dtype) an exported folder carries beside
    the model: ``eos`` is a list where the source folder had several."""

    bos: int | None = None
    eos: int | list[int] | None = None
    pad: int | None = None
    names: dict[str, str] = dataclass_field(default_factory=dict)  # bos_token/eos_token/pad_token
    dtype: str | None = None

    def config_fields(self) -> dict[str, Any]:
        return {k: v for k, v in (("bos_token_id", self.bos), ("eos_token_id", self.eos),
                                  ("pad_token_id", self.pad)) if v is not None}


def refuse_dropped(key: str, value: Any, arch: str, why: str) -> None:
    """For ``to_hf``: ``value`` (our ``key``) has no place in ``arch`` and would change
    what the export computes unless it is zero: an error then, never a silent
    difference. Meta tensors (name probes) pass."""
    if getattr(value, "is_meta", False) or not hasattr(value, "any"):
        return
    full = value.full_tensor() if hasattr(value, "full_tensor") else value
    if bool(full.any()):
        raise ConfigError(
            f"{key}: the trained {why} has no place in {arch}; the exported model would "
            f"differ from the trained one (max |value| {float(full.abs().max()):.3g})"
        )


_LLAMA3_ROPE = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def rope_from_hf(hf: dict[str, Any], *, default_theta: float, plugin: str, prefix: str = "") -> dict[str, Any]:
    """``{"rope_theta", "rope_scaling"}`` of the core's RoPE (components) from config.json:
    ``rope_parameters`` (transformers 5) or ``rope_scaling`` + ``rope_theta`` (4.x files),
    rope type ``default`` or ``llama3``; any other type or field is one error line naming it
    (``prefix``: where the fields sit, e.g. ``text_config.``)."""
    key = "rope_parameters" if hf.get("rope_parameters") else "rope_scaling"
    rope = dict(hf.get(key) or {})
    theta = rope.pop("rope_theta", None)
    theta = float(theta if theta is not None else hf.get("rope_theta") or default_theta)
    rope_type = rope.pop("rope_type", rope.pop("type", "default"))
    where = f"config.json: {prefix}{key}"
    out: dict[str, Any] = {"rope_theta": theta}
    if rope_type == "default":
        out["rope_scaling"] = {"enabled": False}
    elif rope_type == "llama3":
        missing = [f for f in _LLAMA3_ROPE if rope.get(f) is None]
        if missing:
            raise ConfigError(f"{where}.{missing[0]}=None: rope_type 'llama3' needs it")
        out["rope_scaling"] = {
            "enabled": True, "scaling_factor": float(rope.pop("factor")),
            "low_freq_factor": float(rope.pop("low_freq_factor")),
            "high_freq_factor": float(rope.pop("high_freq_factor")),
            "original_max_position_embeddings": int(rope.pop("original_max_position_embeddings")),
        }
    else:
        raise ConfigError(f"{where}.rope_type={rope_type!r}: the {plugin} plugin implements default and llama3 RoPE")
    if rope:
        field = next(iter(rope))
        raise ConfigError(f"{where}.{field}={rope[field]!r}: not implemented by the {plugin} plugin")
    return out

