"""The hf-round-trip contract: the Hugging Face side of a plugin (``model.hf``, ``titan-export``).

``check_hf_round_trip(target)``: the adapter's ``from_hf(to_hf(sd))`` gives back the
model's ``state_dict()`` exactly (same keys, bitwise equal tensors, loads strictly),
and, where the plugin maps config.json both ways, ``config_from_hf(config_to_hf(c))``
gives back ``c``'s values. A plugin without ``to_hf`` / ``from_hf`` skips with the
reason (its models cannot load or export Hugging Face folders).
"""

from __future__ import annotations

from enum import Enum
from typing import Any

from titan_plugins.testing.conformance.build import initialise
from titan_plugins.testing.conformance.contract import CheckResult, ContractError, one_line, where
from titan_plugins.testing.conformance.session import Session, open_session
from titan_plugins.testing.conformance.target import Target

__all__ = ["check_hf_round_trip", "check_hf_transformers"]

CONTRACT = "hf-round-trip"


def _flat(values: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in values.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _value(config: Any, dotted: str) -> Any:
    for part in dotted.split("."):  # a schema's dict field (free-form values) is walked by key
        config = config[part] if isinstance(config, dict) else getattr(config, part)
    return config.value if isinstance(config, Enum) else config


def check_hf_round_trip(target: Target | Session) -> CheckResult:
    import torch

    session = open_session(target)
    spec, config = session.spec, session.config
    adapter_cls = spec.load("state_dict_adapter")
    if adapter_cls is None or not (hasattr(adapter_cls, "to_hf") and hasattr(adapter_cls, "from_hf")):
        return (f"model {spec.name!r} has no state-dict adapter with to_hf/from_hf: "
                "model.hf and titan-export are not available for it")
    model, _ = initialise(session)
    sd = model.state_dict()
    adapter = adapter_cls(config)
    try:
        back = adapter.from_hf(adapter.to_hf(sd))
    except Exception as exc:
        raise ContractError(CONTRACT, f"from_hf(to_hf(state_dict())) raised {one_line(exc)}",
                            "make to_hf and from_hf inverse name maps of every state_dict() entry") from None
    missing, extra = sorted(set(sd) - set(back)), sorted(set(back) - set(sd))
    if missing or extra:
        what = f"loses {missing[0]!r}" if missing else f"adds {extra[0]!r}"
        raise ContractError(CONTRACT, f"from_hf(to_hf(state_dict())) {what}",
                            "map every entry both ways (entries not in Hugging Face checkpoints, "
                            "like a tied output weight or an expert bias, are re-created by from_hf)")
    for key, value in sd.items():
        other = back[key]
        if tuple(other.shape) != tuple(value.shape) or not torch.equal(other.to(value.dtype), value):
            raise ContractError(CONTRACT, f"from_hf(to_hf(state_dict())) changes {key!r}",
                                "to_hf and from_hf must be exact inverses (same split/fuse order)")
    model.load_state_dict(back, strict=True)

    to_hf_cfg, from_hf_cfg = spec.load("config_to_hf"), spec.load("config_from_hf")
    if to_hf_cfg is None or from_hf_cfg is None:
        if to_hf_cfg is None and from_hf_cfg is None:
            return None  # the weights map both ways; config.json is not the plugin's
        one = "config_to_hf" if to_hf_cfg is not None else "config_from_hf"
        raise ContractError(CONTRACT, f"model {spec.name!r} maps config.json one way only ({one})",
                            "set both config_from_hf and config_to_hf in the ModelSpec")
    from titan_plugins.errors import ConfigError

    try:
        hf = to_hf_cfg(config)
    except ConfigError as exc:  # this config has no Hugging Face form, on purpose
        return f"the weights round-trip; config_to_hf refuses this config ({exc})"
    for key in ("architectures", "model_type"):
        if not hf.get(key):
            raise ContractError(CONTRACT, f"config_to_hf gives no {key!r}",
                                "transformers needs architectures and model_type to load the folder")
    try:
        values = _flat(from_hf_cfg(hf))
    except Exception as exc:
        raise ContractError(CONTRACT, f"config_from_hf(config_to_hf(config)) raised {one_line(exc)}",
                            "config_from_hf must accept what config_to_hf writes") from None
    # Training settings a config.json cannot carry (a router bias for an architecture that
    # has none): the plugin's hf_config module lists them in HF_TRAINING_ONLY; config_from_hf
    # turns them off for a folder, and the export refuses what they trained.
    import sys

    training_only = set(getattr(sys.modules.get(getattr(from_hf_cfg, "__module__", "")), "HF_TRAINING_ONLY", ()))
    for key, value in values.items():
        ours = _value(config, key)
        if key in training_only:
            continue
        if ours != value and not (isinstance(ours, float) and isinstance(value, float) and abs(ours - value) < 1e-12):
            raise ContractError(CONTRACT, f"config_from_hf(config_to_hf(config)) gives {key}={value!r}, "
                                f"the config has {ours!r}", "map each field the same way both ways")
    return None


# ------------------------------------------------------------ against transformers
TRANSFORMERS = "hf-transformers"
_BOOKKEEPING = frozenset({"architectures", "model_type", "transformers_version", "dtype", "torch_dtype",
                          "_name_or_path"})
# Written for an architecture that lacks them, these change no logits (bookkeeping, and
# MoE training-loss switches a dense config may carry): not reported as dropped.
_HARMLESS = frozenset({"output_router_logits", "router_aux_loss_coef", "use_cache", "initializer_range",
                       "pad_token_id", "bos_token_id", "eos_token_id"})


def _same(written: Any, read: Any) -> bool:
    """``read`` (transformers' value) holds what ``written`` said: numbers equal up to
    float printing, dicts on the keys written (``type`` read as ``rope_type``)."""
    import math

    if isinstance(written, dict):
        return isinstance(read, dict) and all(
            _same(v, read[k] if k in read else read.get("rope_type" if k == "type" else k)) for k, v in written.items())
    if isinstance(written, list | tuple):
        return isinstance(read, list | tuple) and len(written) == len(read) and \
            all(_same(a, b) for a, b in zip(written, read, strict=True))
    if isinstance(written, bool) or isinstance(read, bool):
        return written is read or written == read and type(written) is type(read)
    if isinstance(written, int | float) and isinstance(read, int | float):
        return math.isclose(written, read, rel_tol=1e-9, abs_tol=0.0)
    return written == read


def _modeling_source(model_cls: Any) -> str:
    import inspect
    import sys

    try:
        return inspect.getsource(sys.modules[model_cls.__module__])
    except (OSError, TypeError, KeyError):
        return ""


def _referenced(source: str, name: str) -> bool:
    """The modeling code reads ``name`` though the config class does not declare it
    (``config.head_dim`` or ``getattr(config, "head_dim", ...)``)."""
    import re

    return re.search(rf"config\.{re.escape(name)}\b|[\"']{re.escape(name)}[\"']", source) is not None


def _config_problem(hf: dict[str, Any], loaded: Any, model_cls: Any) -> str | None:
    """The first field of ``config_to_hf``'s dict that transformers' config class does
    not read back as written (a field it ignores, renames or converts), or ``None``."""
    import difflib
    import json

    cfg_cls = model_cls.config_class
    if type(loaded) is not cfg_cls:
        return (f"model_type={hf.get('model_type')!r} gives transformers' {type(loaded).__name__}, "
                f"but {model_cls.__name__} uses {cfg_cls.__name__}")
    read = json.loads(loaded.to_json_string(use_diff=False))
    aliases = dict(getattr(cfg_cls, "attribute_map", None) or {})
    # what the class declares: some classes keep unknown keys as attributes, others drop them
    try:
        known = set(json.loads(cfg_cls().to_json_string(use_diff=False)))
    except Exception:  # a class without defaults for every field
        known = set(read)
    known |= set(getattr(cfg_cls, "__dataclass_fields__", ()))
    source = _modeling_source(model_cls)
    rope = read.get("rope_parameters") if isinstance(read.get("rope_parameters"), dict) else None
    for key, value in hf.items():
        if key in _BOOKKEEPING:
            continue
        name = aliases.get(key, key)
        if name in read and (name in known or _referenced(source, name)):
            if not _same(value, read[name]):
                return f"config_to_hf writes {key}={value!r}; transformers' {cfg_cls.__name__} reads it as {read[name]!r}"
        elif rope is not None and key in ("rope_theta", "rope_scaling", "partial_rotary_factor"):
            inside = value if isinstance(value, dict) else None if value is None else {key: value}
            if inside is not None and not _same(inside, rope):
                return (f"config_to_hf writes {key}={value!r}; transformers' {cfg_cls.__name__} reads "
                        f"rope_parameters={rope!r}")
        elif key in _HARMLESS:
            continue
        else:
            close = difflib.get_close_matches(key, sorted(known | set(aliases)), n=1, cutoff=0.6)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            return (f"config_to_hf writes {key}={value!r}, which transformers' {cfg_cls.__name__} does not "
                    f"read: it is dropped{hint}")
    return None


def _perturb(model: Any, seed: int, scale: float) -> None:
    """Random weights away from the init scheme's small values (a tiny-std init makes
    near-uniform logits, where a mapping mistake hides); parameters only (buffers such
    as a rotary cache are derived, not saved)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for tensor in model.parameters():
            if tensor.is_floating_point() and tensor.numel():
                tensor.add_(torch.randn(tensor.shape, generator=gen, dtype=tensor.dtype) * scale)


def check_hf_transformers(target: Target | Session, *, attn_implementation: str = "eager",
                          tolerance: float = 1e-5, scale: float = 0.05) -> CheckResult:
    """Against transformers' own model, when transformers is installed and knows the
    architecture ``config_to_hf`` names (``architectures[0]``):

    - config.json round-trips through transformers' config class: every field
      ``config_to_hf`` writes is read back as written (a field transformers ignores,
      such as ``num_experts`` for Mixtral's ``num_local_experts``, fails, naming it);
    - a tiny random transformers model built from that config and saved with
      ``save_pretrained`` loads into the plugin's model (``titan_plugins.hf.load_hf_model``)
      with transformers' logits (fp32, within ``tolerance`` relative to the largest
      logit): a mistake made the same way in ``to_hf`` and ``from_hf`` (a w1/w3 swap)
      shows here, not in the round trip;
    - the plugin's export of it (``export_model``) loads strictly in transformers with
      the same logits.

    Returns the reason when it does not apply (no transformers, an architecture it
    does not know, no Hugging Face mapping): ``check_hf_round_trip`` then stands alone."""
    import json
    import tempfile
    from pathlib import Path

    session = open_session(target)
    spec = session.spec
    adapter_cls = spec.load("state_dict_adapter")
    to_hf_cfg = spec.load("config_to_hf")
    if adapter_cls is None or not hasattr(adapter_cls, "from_hf") or to_hf_cfg is None \
            or spec.load("config_from_hf") is None:
        return (f"model {spec.name!r} has no Hugging Face mapping (state_dict_adapter with from_hf, "
                "config_from_hf, config_to_hf): nothing to compare with transformers")
    try:
        import torch
        import transformers
    except ImportError:
        return "transformers is not installed: only hf-round-trip (self-consistency) checks the mapping"
    from titan_plugins.errors import ConfigError

    try:
        hf = dict(to_hf_cfg(session.config))
    except ConfigError as exc:  # refused on purpose: this config has no Hugging Face form
        return f"config_to_hf refuses this config ({exc}): choose overrides transformers can express"
    except Exception as exc:
        raise ContractError(TRANSFORMERS, f"config_to_hf(config) raised {one_line(exc)}",
                            "config_to_hf must map every flavor's config") from None
    arch = (hf.get("architectures") or [None])[0]
    model_cls = getattr(transformers, arch, None) if isinstance(arch, str) else None
    if model_cls is None or not hasattr(model_cls, "config_class"):
        return (f"transformers {transformers.__version__} has no {arch}: only hf-round-trip "
                "(self-consistency) checks the mapping")
    fix_config = (f"write config.json fields under the names and in the form transformers' "
                  f"{model_cls.config_class.__name__} reads (and read them so in config_from_hf)")
    with tempfile.TemporaryDirectory(prefix="titan-kit-hf-") as tmp:
        folder = Path(tmp) / "hf"
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(hf, indent=2))
        try:
            hf_config = transformers.AutoConfig.from_pretrained(folder)
        except Exception as exc:
            raise ContractError(TRANSFORMERS, f"transformers cannot read config_to_hf's config.json: "
                                f"{one_line(exc)}", fix_config) from None
        problem = _config_problem(hf, hf_config, model_cls)
        if problem is not None:
            raise ContractError(TRANSFORMERS, problem, fix_config)

        torch.manual_seed(0)
        reference = model_cls._from_config(hf_config, attn_implementation=attn_implementation).float()
        _perturb(reference, 0, scale)
        reference.eval().save_pretrained(folder)
        from titan_plugins.hf import export_model, load_hf_model

        try:
            ours = load_hf_model(spec.name, folder, overrides=session.target.overrides, pm=session.pm)
        except Exception as exc:
            raise ContractError(TRANSFORMERS, f"loading the folder transformers' {arch} saved raised "
                                f"{one_line(exc)}{where(exc)}", "config_from_hf must accept what "
                                "transformers writes (list fields that change nothing in NO_EFFECT / "
                                "no_effect) and from_hf must map every tensor it saves") from None
        vocab = int(getattr(session.config, "vocab_size", None) or hf_config.vocab_size)
        tokens = torch.randint(0, vocab, (2, 12), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            want = reference(tokens).logits
            got = ours(tokens)
        limit = tolerance * max(1.0, float(want.abs().max()))
        diff = float((got - want).abs().max()) if got.shape == want.shape else float("inf")
        if not diff <= limit:
            raise ContractError(
                TRANSFORMERS, f"{arch} loaded from a random transformers model gives logits "
                f"{diff:.3g} from transformers' own (tolerance {limit:.3g})",
                "check the name map against transformers' safetensors names (a swapped pair, such as "
                "gate/up or w1/w3, maps consistently both ways and passes hf-round-trip) and that "
                "config_from_hf honours every field that changes the computation")
        out = export_model(ours, spec, Path(tmp) / "out")
        try:
            again, info = model_cls.from_pretrained(out, output_loading_info=True,
                                                    attn_implementation=attn_implementation)
        except Exception as exc:
            raise ContractError(TRANSFORMERS, f"transformers cannot load the plugin's export: {one_line(exc)}",
                                "config_to_hf and to_hf must write what transformers reads") from None
        bad = {k: v for k, v in info.items() if v}
        if bad:
            kind, names = next(iter(bad.items()))
            raise ContractError(TRANSFORMERS, f"the export loads in transformers with {kind} "
                                f"{sorted(map(str, names))[:3]}", "map every tensor of transformers' "
                                "checkpoint in to_hf, under its safetensors name")
        with torch.no_grad():
            back = float((again.float().eval()(tokens).logits - want).abs().max())
        if not back <= limit:
            raise ContractError(TRANSFORMERS, f"the plugin's export gives logits {back:.3g} from the "
                                f"model it was loaded from, in transformers (tolerance {limit:.3g})",
                                "to_hf must write what from_hf read (the same name map both ways)")
    return None
