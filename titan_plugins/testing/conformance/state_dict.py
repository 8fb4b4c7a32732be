"""The state-dict contract: ``state_dict()`` holds learned state only."""

from __future__ import annotations

from collections.abc import Sequence

from titan_plugins.testing.conformance.build import initialise
from titan_plugins.testing.conformance.contract import CheckResult, ContractError
from titan_plugins.testing.conformance.session import Session, open_session
from titan_plugins.testing.conformance.target import Target

__all__ = ["check_state_dict"]

_DERIVED_NAMES = {"freqs_cis", "rope_cache", "rope", "inv_freq", "cos_cached", "sin_cached",
                  "cos_cache", "sin_cache", "cos", "sin", "causal_mask", "attn_mask", "mask",
                  "position_ids"}


def check_state_dict(target: Target | Session, *, persistent_buffers: Sequence[str] = ()) -> CheckResult:
    """``state_dict()`` holds learned state only. A persistent buffer fails when it is
    a rotary/mask cache by name, complex, or rebuilt by ``init_weights`` to the same
    non-constant value for every seed (i.e. derived from the config). Buffers that
    are real state (MoE expert biases, counters) pass; ``persistent_buffers`` lists
    names (full or last component) to accept anyway."""
    import torch

    model, other = initialise(open_session(target))
    keys = set(model.state_dict().keys())
    other_buffers = dict(other.named_buffers())
    allowed = set(persistent_buffers)
    for name, buf in model.named_buffers():
        if name not in keys or name in allowed or name.rsplit(".", 1)[-1] in allowed:
            continue
        leaf = name.rsplit(".", 1)[-1]
        if leaf in _DERIVED_NAMES:
            why = "a cache derived from the config"
        elif buf.is_complex():
            why = "a complex cache derived from the config"
        elif buf.numel() > 1 and buf.is_floating_point() and torch.equal(buf, other_buffers[name]) \
                and not torch.all(buf == buf.flatten()[0]):
            why = "rebuilt by init_weights to the same values for every seed (derived from the config)"
        else:
            continue
        raise ContractError(
            "state-dict", f"buffer {name!r} is saved in state_dict(), but it is {why}",
            f"register it with self.register_buffer({leaf!r}, ..., persistent=False) and rebuild it in "
            "init_weights(buffer_device); checkpoints hold learned state only (list it in "
            "persistent_buffers if it really is state)")
    return None
