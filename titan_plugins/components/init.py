"""TorchTitan's initialisation helpers, shared by the first-party models.

Seeded equality with TorchTitan depends on the exact calls and their order, so the
models call these rather than ``nn.init`` directly.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["depth_scaled_std", "init_block_", "init_decoder_", "init_output_", "trunc_normal_"]


def trunc_normal_(
    tensor: torch.Tensor, mean: float = 0.0, std: float = 1.0, a: float = -2.0, b: float = 2.0
) -> None:
    """TorchTitan's truncated normal (absolute bounds ``[a, b]``): sampled in float32,
    cast back, so a bf16 parameter gets the same draw as an fp32 one."""
    tmp = tensor.float()
    nn.init.trunc_normal_(tmp, mean=mean, std=std, a=a, b=b)
    if tmp is not tensor:
        with torch.no_grad():
            tensor.copy_(tmp)


def init_output_(weight: torch.Tensor, dim: int, cutoff: float = 3.0) -> None:
    """The output projection: truncated normal with std ``dim**-0.5`` cut at ``cutoff`` sigma."""
    std = dim**-0.5
    trunc_normal_(weight, mean=0.0, std=std, a=-cutoff * std, b=cutoff * std)


def depth_scaled_std(layer_id: int, n_layers: int, depth_init: bool = True) -> float:
    """TorchTitan's depth-scaled init std: shrinks with the block's depth (or with the
    model's depth when ``depth_init`` is off)."""
    depth = layer_id + 1 if depth_init else n_layers
    return 0.02 / (2 * depth) ** 0.5


def init_block_(block: nn.Module, buffer_device: torch.device | None) -> None:
    """A transformer block in TorchTitan's order: both norms, the attention (its own
    ``init_weights(std)``), then the MoE or the dense feed-forward with the block's std."""
    block.attention_norm.reset_parameters()
    block.ffn_norm.reset_parameters()
    block.attention.init_weights(block.weight_init_std)
    if block.moe_enabled:
        block.moe.init_weights(block.weight_init_std, buffer_device)
    else:
        block.feed_forward.init_weights(block.weight_init_std)


def init_decoder_(model: nn.Module, buffer_device: torch.device | None, output: nn.Linear | None, dim: int) -> None:
    """A decoder's parameters in TorchTitan's order: ``tok_embeddings`` N(0, 1), each block
    (``layers``), the final ``norm``, then ``output`` (``init_output_``). Modules a pipeline
    stage does not own are None and skipped. Rebuilding rotary buffers stays the model's."""
    if model.tok_embeddings is not None:
        nn.init.normal_(model.tok_embeddings.weight)
    for layer in model.layers.values():
        if layer is not None:
            layer.init_weights(buffer_device)
    if model.norm is not None:
        model.norm.reset_parameters()
    if output is not None:
        init_output_(output.weight, dim)
