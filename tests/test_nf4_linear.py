"""The QLoRA base's compute (titan_plugins/peft/nf4_linear.py): the byte-lookup
dequantization equals torchao's reference ``get_original_weight`` bit for bit, and the
linear's output and input gradient equal torchao's ``linear_nf4``."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("torchao")

from titan_plugins.peft.nf4_linear import dequantize_nf4, linear_nf4  # noqa: E402
from titan_plugins.peft.qlora import _nf4  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape,scaler_block", [((96, 64), 32), ((128, 256), 256)])
def test_dequantize_equals_torchao_bit_for_bit(dtype, shape, scaler_block):
    to_nf4 = _nf4()[2]
    weight = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(dtype)
    nf4 = to_nf4(weight, 64, scaler_block)
    for out_dtype in (torch.float32, torch.bfloat16):
        want = nf4.get_original_weight().to(out_dtype)
        got = dequantize_nf4(nf4, out_dtype)
        assert got.dtype == out_dtype and got.shape == weight.shape
        assert torch.equal(got, want)


def test_linear_and_its_input_gradient_equal_torchao():
    to_nf4, torchao_linear = _nf4()[2], _nf4()[1]
    gen = torch.Generator().manual_seed(1)
    nf4 = to_nf4(torch.randn(128, 256, generator=gen), 64, 256)
    x = torch.randn(3, 5, 256, generator=gen, requires_grad=True)
    upstream = torch.randn(3, 5, 128, generator=gen)
    got = linear_nf4(x, nf4)
    (got_grad,) = torch.autograd.grad(got, x, upstream)
    want = torchao_linear(x, nf4)
    (want_grad,) = torch.autograd.grad(want, x, upstream)
    assert torch.equal(got, want) and torch.equal(got_grad, want_grad)
