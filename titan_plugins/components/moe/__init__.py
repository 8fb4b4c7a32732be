"""Mixture-of-experts shared by the first-party models (TorchTitan's names and numerics).

``MoEConfig`` and ``ScoreFunc`` import without torch (plugin schemas use them); the
torch-based names load on first access. Parallelism for the MoE lives in
``titan_plugins.distributed.expert_parallel``.
"""

from importlib import import_module

from titan_plugins.components.moe.config import MoEConfig, ScoreFunc

_LAZY = {
    "AllToAllTokenDispatcher": "token_dispatch",
    "GroupedExperts": "experts",
    "MoE": "moe",
    "TokenChoiceTopKRouter": "router",
    "build_load_balance_hooks": "load_balance",
    "update_expert_bias": "load_balance",
}

__all__ = ["MoEConfig", "ScoreFunc", *sorted(_LAZY)]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
