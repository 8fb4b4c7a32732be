"""TorchTitan 0.2.2's Llama 4 built as its trainer builds it, made to run on CPU.

Three deviations from a plain import, all outside the math under test:

* ``torch.histc`` (TorchTitan's router and reorderer count tokens per expert with it)
  has no int64 CPU kernel: ``cpu_histc`` wraps it to count in float32 and hand back
  the input's dtype (exact for counts < 2**24). Tests install it with monkeypatch.
* ``create_attention_mask`` is TorchTitan's ``torch.compile``'d ``create_block_mask``;
  the eager one builds the same ``BlockMask``.
* Its SDPA wrapper's kernel list is set to the math kernel (the tests run ours
  under ``sdpa_kernel(MATH)`` too).
* Flex attention (the ``debugmodel_irope`` path) has no CPU backward, and 0.2.2's
  ``Attention.forward`` hands the whole ``{"rope", "nope"}`` mask dict to the kernel
  instead of the mask it just selected. ``ReferenceKernel`` replaces each layer's
  ``inner_attention``: it picks the layer's mask from the dict and runs either eager
  ``flex_attention`` on TorchTitan's ``BlockMask`` (forward only) or math SDPA with
  a dense boolean mask evaluated from that ``BlockMask``'s own ``mask_mod``.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend

from titan_plugins.testing.model_parts import cpu_histc, seeded_build  # noqa: F401 (re-exported)
from titan_plugins.testing.torchtitan_ref import import_torchtitan


class ReferenceKernel(nn.Module):
    def __init__(self, use_rope: bool, mode: str):
        super().__init__()
        self.key = "rope" if use_rope else "nope"
        self.mode = mode

    def forward(self, q, k, v, *, block_mask, enable_gqa=False, **_):
        bm = block_mask[self.key]
        if self.mode == "flex":
            from torch.nn.attention.flex_attention import flex_attention

            return flex_attention(q, k, v, block_mask=bm, enable_gqa=enable_gqa)
        b, s = q.shape[0], q.shape[2]
        bi = torch.arange(b).view(b, 1, 1, 1)
        hi = torch.zeros(1, 1, 1, 1, dtype=torch.long)
        qi = torch.arange(s).view(1, 1, s, 1)
        ki = torch.arange(s).view(1, 1, 1, s)
        dense = bm.mask_mod(bi, hi, qi, ki).expand(b, 1, s, s)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=dense, enable_gqa=enable_gqa)


def flavor_args(flavor: str, **overrides):
    """A deep copy of TorchTitan's own flavor with ``overrides`` applied."""
    tt = import_torchtitan("torchtitan.models.llama4")
    args = copy.deepcopy(tt.llama4_args[flavor])
    for key, value in overrides.items():
        setattr(args, key, value)
    return args


def build_reference(args, seq_len: int, seed: int, kernel: str = "sdpa_mask") -> nn.Module:
    """Meta build -> ``update_from_config(seq_len)`` -> ``to_empty`` -> seeded
    ``init_weights``, as TorchTitan's trainer does."""
    mm = import_torchtitan("torchtitan.models.llama4.model.model")
    from torch.nn.attention.flex_attention import create_block_mask

    mm.create_attention_mask = create_block_mask
    # Its SDPA wrapper forces [cuDNN, flash, math] by priority (flash on CPU); the
    # comparison runs the math kernel on both sides.
    mm.ScaledDotProductAttentionWrapper.sdpa_backends = [SDPBackend.MATH]
    job = SimpleNamespace(
        training=SimpleNamespace(seq_len=seq_len),
        parallelism=SimpleNamespace(context_parallel_degree=1),
        debug=SimpleNamespace(moe_force_load_balance=False),
    )
    args.update_from_config(job)
    model = seeded_build(mm.Transformer, args, seed)  # init under no_grad, as its trainer calls it
    if args.attn_type == "flex":
        for layer in model.layers.values():
            layer.attention.inner_attention = ReferenceKernel(layer.attention.use_rope, kernel)
    return model


def reference_forward(model: nn.Module, tokens: torch.Tensor, eos_id: int = -1) -> torch.Tensor:
    """TorchTitan's forward; with its ``block_causal`` flavors the documents end at
    ``eos_id`` (the tokenizer's, which its trainer passes; -1: one document per row)."""
    if model.model_args.attn_type != "flex":
        return model(tokens)
    masks = model.get_attention_masks(tokens, SimpleNamespace(eos_id=eos_id))
    return model(tokens, attention_masks=masks)
