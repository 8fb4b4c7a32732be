"""Short names for the two sides of a comparison: only the overrides that differ.

``model=qwen3 parallelism=single training.steps=10 checkpoint.init_from=/tmp/...`` vs
``model=qwen3 parallelism=fsdp2_tp2 ...`` reads as ``parallelism=single`` vs
``parallelism=fsdp2_tp2``: what a person needs to tell the curves apart.
"""

from __future__ import annotations

__all__ = ["short_labels"]

# Set by titan-compare itself on both sides (a temporary seed path, the dump switch):
# never what the comparison is about.
_IGNORED = ("checkpoint.init_from", "training.dump_final_params")


def _parse(overrides: list[str]) -> dict[str, str]:
    """``key=value`` pairs, the last one winning as in Hydra; ``+key``/``++key`` as ``key``."""
    out: dict[str, str] = {}
    for item in overrides:
        key, sep, value = item.partition("=")
        key = key.lstrip("+")
        if key in _IGNORED:
            continue
        out[key] = value if sep else ""
    return out


def _shorten(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def short_labels(baseline: list[str], test: list[str], *, limit: int = 60) -> tuple[str, str]:
    """``(baseline label, test label)``: each side's overrides whose key is missing
    from the other side or has another value there, in the order given. Sides that
    differ in no override are ``"same overrides"``."""
    a, b = _parse(baseline), _parse(test)
    keys = list(dict.fromkeys([*a, *b]))
    diff = [k for k in keys if a.get(k) != b.get(k)]

    def label(side: dict[str, str]) -> str:
        parts = [f"{k}={side[k]}" if side[k] else k for k in diff if k in side]
        return _shorten(" ".join(parts), limit) if parts else "(defaults)"

    if not diff:
        return "same overrides", "same overrides"
    return label(a), label(b)
