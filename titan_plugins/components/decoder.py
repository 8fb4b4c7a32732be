"""The pre-norm decoder block and decoder model TorchTitan's Llama/Qwen models share.

``DecoderBlock``: ``h = x + attention(attention_norm(x), rope, mask)``, then
``h + ffn(ffn_norm(h))`` where the FFN is a dense SwiGLU (``feed_forward``) or an MoE
(``moe``). ``Decoder``: ``tok_embeddings`` -> ``layers`` (an ``nn.ModuleDict`` keyed
``"0".."n-1"``) -> ``norm`` -> ``output``, a non-persistent rotary table rebuilt by
``init_weights``, ``block_causal`` document masks, pipeline stages (modules a stage
does not own are None) and KV-cache decoding. A model subclasses both and keeps what
is its own: its attention, its rotary table (``rope_table``), its logits.

Construction order is TorchTitan's (embeddings, blocks, norm, output; inside a block
the attention, then the FFN, then both norms), so a model built directly on a device
draws the same random numbers as TorchTitan's; ``init_weights`` then re-initialises
in TorchTitan's order (``titan_plugins.components.init``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from titan_plugins.components.attention import use_flex
from titan_plugins.components.attention_masks import (
    AttentionMask,
    block_mask,
    dense_mask,
    document_ids,
)
from titan_plugins.components.compute_dtype import ComputeDtypeMixin, cast, linear
from titan_plugins.components.cp_attention import global_seq_len, rope_rows
from titan_plugins.components.gqa import AttentionMaskT
from titan_plugins.components.init import init_block_, init_decoder_

__all__ = ["Decoder", "DecoderBlock", "match_layout"]


def match_layout(out: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """Bring a DTensor branch output to the residual's layout (a no-op when a TP plan's
    output hook already did; needed when compute-dtype casts bypass module hooks)."""
    if isinstance(out, DTensor) and isinstance(residual, DTensor) and out.placements != residual.placements:
        return out.redistribute(placements=residual.placements)
    return out


class DecoderBlock(nn.Module):
    """A pre-norm block over ``attention`` and either ``feed_forward`` or ``moe``.

    ``weight_init_std``: the depth-scaled std of the block's output projections
    (``components.init.depth_scaled_std``). ``forward(x, rope, mask, cache=None)``:
    ``rope`` and ``mask`` go to the attention as they are (a model's attention decides
    what they are: a rotary table, a mask or document ids).
    """

    def __init__(
        self, attention: nn.Module, ffn: nn.Module, *, moe: bool, dim: int, norm_eps: float,
        weight_init_std: float,
    ):
        super().__init__()
        self.attention = attention
        self.moe_enabled = moe
        setattr(self, "moe" if moe else "feed_forward", ffn)
        self.attention_norm = nn.RMSNorm(dim, eps=norm_eps)
        self.ffn_norm = nn.RMSNorm(dim, eps=norm_eps)
        self.weight_init_std = weight_init_std

    def forward(self, x: torch.Tensor, rope: torch.Tensor, mask: Any = None, cache=None) -> torch.Tensor:
        # cache only as a keyword, and only when decoding: a TP plan's input layouts cover the training call
        kw = {} if cache is None else {"cache": cache}
        h = x + match_layout(self.attention(self.attention_norm(x), rope, mask, **kw), x)
        ffn = self.moe if self.moe_enabled else self.feed_forward
        return h + match_layout(ffn(self.ffn_norm(h)), h)

    def init_weights(self, buffer_device: torch.device | None) -> None:
        init_block_(self, buffer_device)


class Decoder(ComputeDtypeMixin, nn.Module):
    """``forward(tokens)``: ids ``(batch, seq)`` on the first pipeline stage, hidden
    states ``(batch, seq, dim)`` on later ones; logits ``(batch, seq, vocab)`` on the
    last stage, else hidden states. ``tok_embeddings``/``norm``/``output`` may be None.

    ``config`` needs ``dim``, ``vocab_size``, ``norm_eps``, ``n_layers``, ``attn_mask``,
    ``attn_backend`` and ``eos_id``. ``block(i)`` builds block ``i``; ``rope_buffer``
    names the rotary table (``rope_table(device)`` builds it); ``tie``: the output
    weight is the embedding weight.
    """

    def __init__(self, config: Any, block: Callable[[int], nn.Module], *, rope_buffer: str, tie: bool = False):
        super().__init__()
        self.config = c = config
        self.rope_buffer, self.tied = rope_buffer, tie
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(c.vocab_size, c.dim)
        # Non-persistent: never in state_dict(), rebuilt by init_weights; a plain tensor
        # even under TP (a TP plan replicates it per call where it meets DTensors).
        self.register_buffer(rope_buffer, self.rope_table(None), persistent=False)
        self.layers = nn.ModuleDict({str(i): block(i) for i in range(c.n_layers)})
        self.norm: nn.RMSNorm | None = nn.RMSNorm(c.dim, eps=c.norm_eps)
        self.output: nn.Linear | None = nn.Linear(c.dim, c.vocab_size, bias=False)
        if tie:
            self.output.weight = self.tok_embeddings.weight
        self.compute_dtype: torch.dtype | None = None

    def rope_table(self, device: torch.device | None) -> torch.Tensor:
        """The rotary table on ``device`` (None: the default device)."""
        raise NotImplementedError

    @property
    def rope(self) -> torch.Tensor:
        return getattr(self, self.rope_buffer)

    # ------------------------------------------------------------------ init
    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        """TorchTitan's scheme and order: embeddings N(0, 1), projections truncated normal
        with depth-scaled std, output truncated normal with std dim**-0.5 cut at 3 sigma
        (tied: the output init overwrites the shared embedding); rebuilds the rotary table."""
        buffer_device = buffer_device or self.rope.device
        setattr(self, self.rope_buffer, self.rope_table(buffer_device))
        # Re-tie (to_empty gives each module its own tensor).
        if self.tied and self.tok_embeddings is not None and self.output is not None:
            self.output.weight = self.tok_embeddings.weight
        init_decoder_(self, buffer_device, self.output, self.config.dim)

    # ---------------------------------------------------------------- masks
    def stage_inputs(self, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
        """What every pipeline stage needs from the token ids (``PipelineInfo.stage_inputs``):
        the document ids of a ``block_causal`` mask; nothing for causal attention."""
        if self.config.attn_mask is AttentionMask.causal:
            return {}
        return {"doc_ids": document_ids(tokens, self.config.eos_id)}

    def attention_mask(self, doc_ids: torch.Tensor | None) -> AttentionMaskT:
        """None for causal attention (the kernel handles it); for ``block_causal``, a
        flex ``BlockMask`` or a boolean SDPA mask from the document ids."""
        c = self.config
        if c.attn_mask is AttentionMask.causal:
            return None
        if doc_ids is None:
            raise ValueError(
                "model.attn_mask=block_causal: a later pipeline stage needs doc_ids "
                "(the trainer passes stage_inputs)"
            )
        # The sequence length is the ids': a later stage's hidden states may be a
        # sequence shard (TP with sequence parallelism).
        build = block_mask if use_flex(c.attn_backend, doc_ids.device) else dense_mask
        return build(doc_ids, doc_ids.shape[1], None, doc_ids.device)

    def decode_mask(self, tokens: torch.Tensor, cache) -> Any:
        """The blocks' ``mask`` argument while decoding (None: the attention asks the cache)."""
        return None

    # -------------------------------------------------------------- forward
    def forward(self, tokens: torch.Tensor, doc_ids: torch.Tensor | None = None, cache=None) -> torch.Tensor:
        """Token ids (first stage) or hidden states; ``doc_ids`` only on later pipeline
        stages under ``block_causal`` (the first stage derives them from the ids).
        ``cache``: a ``titan_plugins.generate.KVCache`` (single stage, decoding only)."""
        if cache is not None:
            return self._decode(tokens, cache)
        seq, rope = global_seq_len(tokens.shape[1]), self.rope
        if seq > rope.shape[0]:
            raise ValueError(
                f"sequence length {seq} exceeds model.max_seq_len={rope.shape[0]} "
                "(the rotary cache length); raise model.max_seq_len"
            )
        rope = rope_rows(rope)  # context parallel: the rows of this rank's global positions
        if self.tok_embeddings is not None:
            if doc_ids is None:
                doc_ids = self.stage_inputs(tokens).get("doc_ids")
            h = self.tok_embeddings(tokens)
        else:
            h = tokens
        mask = self.attention_mask(doc_ids)
        for layer in self.layers.values():
            if layer is not None:
                h = layer(h, rope, mask)
        if self.norm is not None:
            h = self.norm(h)
        return h if self.output is None else self.logits(h)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """The output projection, in the compute dtype."""
        return linear(cast(h, self.compute_dtype), self.output, self.compute_dtype)

    def _decode(self, tokens: torch.Tensor, cache) -> torch.Tensor:
        """The new tokens at positions ``cache.pos..``, attending to the cache."""
        h = self.tok_embeddings(tokens)
        rope = self.rope[cache.pos :]
        mask = self.decode_mask(tokens, cache)
        for name, layer in self.layers.items():
            h = layer(h, rope, mask, cache.layer(name))
        return self.logits(self.norm(h))
