"""Schema of Llama 3.1-style RoPE frequency scaling (torch-free: config modules import it).

The functions that use it are in ``titan_plugins.components.rope``.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["RoPEScaling"]


@dataclass
class RoPEScaling:
    """Llama 3.1's frequency scaling (TorchTitan's ``RoPEScalingArgs``; Hugging Face's
    ``rope_type: llama3``). ``enabled=False`` is plain RoPE (TorchTitan's
    ``rope_scaling_args=None``, a config.json without ``rope_scaling``); a nested node
    rather than an Optional one, so ``model.rope_scaling.scaling_factor=32`` works as an
    override. The defaults are Llama 3.1's; a plugin whose model differs (Llama 4) states
    its own values in its flavors."""

    enabled: bool = True
    scaling_factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

