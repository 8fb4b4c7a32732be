"""``x W^T`` over a 4-bit NF4 weight (torchao's ``NF4Tensor``), dequantized by a
byte lookup: the QLoRA base's compute.

torchao's own ``linear_nf4`` dequantizes with its reference code (two nibble
extractions, two table lookups, two scale products and an interleave: ~10 passes
over the weight), which on CPU costs more than the matmul it feeds at short
sequences. Here each stored byte (two 4-bit codes) indexes a 256 x 2 table of
value pairs built from the tensor's own NF4 code book, and one product applies each
block's scale: the same elements as ``NF4Tensor.get_original_weight`` bit for bit
(one table lookup and one multiply per element in both; tests/test_qlora.py checks
equality), in a fraction of the time (benchmarks/README.md, Memory).

Like torchao's, the autograd function keeps only the 4-bit weight for the backward
and dequantizes it again there (the weight never trains).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["dequantize_nf4", "linear_nf4"]


def _pair_table(code_book: torch.Tensor) -> torch.Tensor:
    """``[256, 2]``: byte ``b`` -> (value of its high nibble, value of its low nibble)."""
    byte = torch.arange(256, device=code_book.device)
    return torch.stack([code_book[byte >> 4], code_book[byte & 0b1111]], dim=1)


def dequantize_nf4(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An ``NF4Tensor`` as a plain tensor of ``dtype``, equal to
    ``weight.get_original_weight().to(dtype)``."""
    scales = weight.dequantize_scalers(weight.quantized_scalers, weight.quantization_factor,
                                       weight.scaler_block_size)
    pairs = F.embedding(weight.quantized_data.view(-1).int(), _pair_table(weight.nf4))
    values = pairs.view(-1, weight.block_size) * scales.unsqueeze(-1)
    return values.view(weight.shape).to(dtype)


class _NF4Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(weight)
        return F.linear(x, dequantize_nf4(weight, x.dtype))

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out: torch.Tensor):
        (weight,) = ctx.saved_tensors
        return grad_out @ dequantize_nf4(weight, grad_out.dtype), None


def linear_nf4(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x W^T`` in ``x``'s dtype; gradient for ``x`` only."""
    return _NF4Linear.apply(x, weight)
