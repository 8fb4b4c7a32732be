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
from titan_plugins.testing.conformance.contract import CheckResult, ContractError, one_line
from titan_plugins.testing.conformance.session import Session, open_session
from titan_plugins.testing.conformance.target import Target

__all__ = ["check_hf_round_trip"]

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
    for part in dotted.split("."):
        config = getattr(config, part)
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
        return None if to_hf_cfg is None and from_hf_cfg is None else \
            f"model {spec.name!r} maps config.json one way only: set both config_from_hf and config_to_hf"
    hf = to_hf_cfg(config)
    for key in ("architectures", "model_type"):
        if not hf.get(key):
            raise ContractError(CONTRACT, f"config_to_hf gives no {key!r}",
                                "transformers needs architectures and model_type to load the folder")
    try:
        values = _flat(from_hf_cfg(hf))
    except Exception as exc:
        raise ContractError(CONTRACT, f"config_from_hf(config_to_hf(config)) raised {one_line(exc)}",
                            "config_from_hf must accept what config_to_hf writes") from None
    for key, value in values.items():
        ours = _value(config, key)
        if ours != value and not (isinstance(ours, float) and isinstance(value, float) and abs(ours - value) < 1e-12):
            raise ContractError(CONTRACT, f"config_from_hf(config_to_hf(config)) gives {key}={value!r}, "
                                f"the config has {ours!r}", "map each field the same way both ways")
    return None
