"""A transformers causal LM in the core's model lifecycle.

``AutoModelForCausalLM.from_config`` builds the model (on meta under the core); its
modules are hoisted to the names every core helper knows (``tok_embeddings``,
``layers`` as an ``nn.ModuleDict`` keyed ``"0".."n-1"``, ``norm``, ``output``) and
this module drives them as the architecture's own ``forward`` does: embeddings,
positions, the attention masks of each layer type (full, sliding), rotary embeddings
(per layer type where the model has several), the decoder layers, norm, head and what
the class's forward does to the logits after its head (``titan_hf.head``). So a
pipeline stage can drop the modules it does not own, and a later stage rebuilds masks and rotary embeddings from its hidden states (rotary lives
on every stage). ``init_weights`` is the architecture's own ``_init_weights``, which
also recomputes the non-persistent buffers (rotary ``inv_freq``, Gemma's
``embed_scale``) that ``to_empty`` leaves as garbage.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

from titan_hf.architecture import attn_implementation, check_architecture
from titan_hf.config import AttnImpl, HFModelConfig, hf_dict
from titan_hf.context_parallel import sharded_positions_and_masks
from titan_hf.embed import embed_work
from titan_hf.head import post_head, pre_head
from titan_hf.layer_call import cache_keyword, check_layer_call, makes_sliding_masks
from titan_hf.structure import find_structure
from titan_plugins.components.attention_masks import AttentionMask, document_ids
from titan_plugins.components.cp_attention import current_shard
from titan_plugins.errors import ConfigError

__all__ = ["HFCausalLM", "build", "flops", "hf_config_object"]

_MASKS = ("full_attention", "sliding_attention")


def hf_config_object(config: HFModelConfig) -> Any:
    """transformers' config object for ``config`` (attention kernel resolved:
    :func:`titan_hf.architecture.attn_implementation`)."""
    from transformers import AutoConfig, PreTrainedConfig

    values = PreTrainedConfig._decode_special_floats(hf_dict(config))  # config.json's {"__float__": "Infinity"}
    cls = check_architecture(values)
    model_type = values.pop("model_type")
    hf = AutoConfig.for_model(model_type, **values)
    hf._attn_implementation = attn_implementation(cls, AttnImpl(config.attn_implementation).value)
    return hf


def layer_kinds(hf: Any) -> list[str]:
    """Each decoder layer's attention kind: ``layer_types`` where the config has it,
    else sliding for every layer iff ``sliding_window`` is set (Mistral, Phi-3)."""
    kinds = getattr(hf, "layer_types", None)
    if kinds:
        return list(kinds)[: hf.num_hidden_layers]
    kind = "sliding_attention" if getattr(hf, "sliding_window", None) else "full_attention"
    return [kind] * hf.num_hidden_layers


class HFCausalLM(nn.Module):
    """``forward(tokens) -> logits`` (or hidden states in, hidden states out on a
    pipeline stage that lacks the embedding or the head)."""

    def __init__(self, config: HFModelConfig) -> None:
        super().__init__()
        from transformers import AutoModelForCausalLM

        self.config = config
        self.hf_config = hf = hf_config_object(config)
        shell = AutoModelForCausalLM.from_config(hf, attn_implementation=hf._attn_implementation)
        self.structure = parts = find_structure(shell)  # from the model's declarations, not names
        if parts.rotary is None:
            raise ConfigError(f"model=hf: {type(shell).__name__} has no rotary embedding module: its positions "
                              "are made inside its base model's forward, which model=hf does not drive")
        self.tok_embeddings: nn.Module | None = shell.get_submodule(parts.embeddings)
        self.layers = nn.ModuleDict({str(i): layer for i, layer in enumerate(shell.get_submodule(parts.layers))})
        self.norm: nn.Module | None = shell.get_submodule(parts.norm)
        self.output: nn.Module | None = shell.get_submodule(parts.head)
        self.rotary_emb = shell.get_submodule(parts.rotary)
        # Not a submodule (its parameters are ours, hoisted): kept for its _init_weights
        # and no_split_modules only.
        object.__setattr__(self, "_shell", shell)
        self.layer_kinds = layer_kinds(hf)
        if not makes_sliding_masks(shell.get_submodule(parts.base)):  # sliding_window set, never used (Youtu)
            self.layer_kinds = ["full_attention"] * len(self.layer_kinds)
        self._rope_per_kind = "layer_type" in inspect.signature(self.rotary_emb.forward).parameters
        # What the class's forward does to the logits after its head (scale, soft-cap),
        # transformers' own statements; the fused loss would skip it: whole logits then.
        self.post_head = post_head(shell, parts.head) if "." not in parts.head else _nested_head(shell, parts.head)
        self.titan_fused_loss = self.post_head is None
        self.pre_head = pre_head(shell, parts.head)  # ... and before it (MiniCPM3's logits_scaling)
        check_layer_call(shell.get_submodule(parts.base))  # layers taking more than masks, positions, rotary: one line
        self.cache_keyword = cache_keyword(shell.get_submodule(parts.base))  # how its layers take the KV cache
        # ... and what its base model's forward does to the embeddings before the layers
        self.embed_work = embed_work(shell.get_submodule(parts.base))
        # packed rows: positions restart per document, which transformers' mask builders
        # turn into a block-causal mask (their packed-sequence path) and rotary follows
        self.block_causal = AttentionMask(config.attn_mask) == AttentionMask.block_causal
        eos = getattr(hf, "eos_token_id", None)
        self.eos_id = eos[0] if isinstance(eos, list) else eos
        self.seq_shards = 1  # > 1 under sequence parallelism: hidden states hold 1/seq_shards of the sequence

    @property
    def no_split_modules(self) -> set[str]:
        return set(getattr(self._shell, "_no_split_modules", None) or ())

    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        """The architecture's initialisation, module by module, and its buffers."""
        if self.config.enable_weight_tying and self.tok_embeddings is not None and self.output is not None:
            self.output.weight = self.tok_embeddings.weight  # to_empty gives each its own tensor
        for module in self.modules():
            if module is not self:
                for p in module.parameters(recurse=False):
                    p._is_hf_initialized = False  # transformers' init skips flagged tensors
                self._shell._init_weights(module)

    def _masks(self, like: torch.Tensor, positions: torch.Tensor, cache: Any) -> dict[str, Any]:
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        makers = {"full_attention": create_causal_mask, "sliding_attention": create_sliding_window_causal_mask}
        return {kind: makers[kind](config=self.hf_config, inputs_embeds=like, attention_mask=None,
                                   cache=cache, position_ids=positions)
                for kind in set(self.layer_kinds)}

    def _hf_cache(self, cache: Any) -> Any:
        """transformers' own cache, kept on the core's ``KVCache`` for the whole decode
        (sliding layers get transformers' sliding caches)."""
        if cache is None:
            return None
        hf_cache = getattr(cache, "_titan_hf_cache", None)
        if hf_cache is None:
            from transformers import DynamicCache

            hf_cache = cache._titan_hf_cache = DynamicCache(config=self.hf_config)
        return hf_cache

    def _check_decoding(self) -> None:
        """Once per model, at the first forward with a KV cache: one line where cached
        decoding cannot equal recomputing the whole sequence."""
        if getattr(self, "_decoding_checked", False):
            return
        why = decoding_refusal(self.config.architecture, self.cache_keyword, self.hf_config)
        if why is not None:
            raise ConfigError(why)
        self._decoding_checked = True

    def _rope(self, like: torch.Tensor, positions: torch.Tensor) -> dict[str, Any]:
        if self._rope_per_kind:
            return {kind: self.rotary_emb(like, positions, kind) for kind in set(self.layer_kinds)}
        shared = self.rotary_emb(like, positions)
        return dict.fromkeys(set(self.layer_kinds), shared)

    def forward(self, tokens: torch.Tensor, cache: Any = None) -> torch.Tensor:
        """``cache``: a ``titan_plugins.generate.KVCache`` (decoding, one stage only);
        its ``pos`` is the rotary offset, transformers' cache holds the keys/values."""
        from torch.distributed.tensor import DTensor

        if self.tok_embeddings is not None:
            h = self.tok_embeddings(tokens)
            if self.embed_work is not None:
                h = self.embed_work(h)
                if isinstance(h, DTensor):  # NanoChat's final norm also runs here: under SP it
                    h = h.to_local()  # returns a sequence-shard DTensor; the layers take the local shard
        else:
            h = tokens

        local = h.to_local() if isinstance(h, DTensor) else h
        batch, seq = local.shape[0], local.shape[1] * self.seq_shards
        # Masks and rotary read only the shape, dtype and device of what they are given.
        like = local.new_empty((batch, seq, 1))
        hf_cache, shard = self._hf_cache(cache), current_shard()
        if shard is not None:  # parallelism.cp: global positions, masks over the whole row's keys
            docs = document_ids(tokens, self.eos_id) if self.block_causal else None
            positions, masks = sharded_positions_and_masks(
                shard, set(self.layer_kinds), getattr(self.hf_config, "sliding_window", None), docs, local.device)
        else:
            past = cache.pos if cache is not None else 0
            positions = torch.arange(past, past + seq, device=local.device).unsqueeze(0)
            if self.block_causal and cache is None and self.tok_embeddings is not None:
                positions = document_positions(document_ids(tokens, self.eos_id))
            masks = self._masks(like, positions, hf_cache)
        rope = self._rope(like, positions)
        if hf_cache is not None:
            self._check_decoding()
        extra = {} if hf_cache is None else {self.cache_keyword: hf_cache, "use_cache": True}
        for key, layer in self.layers.items():
            kind = self.layer_kinds[int(key)]
            out = layer(h, attention_mask=masks[kind], position_embeddings=rope[kind], position_ids=positions,
                        **extra)
            h = out[0] if isinstance(out, tuple) else out
        if self.norm is not None:
            h = self.norm(h)
        if self.output is not None:
            h = self.output(h if self.pre_head is None else self.pre_head(h))
            if self.post_head is not None:
                h = self.post_head(h)
        return h


def decoding_refusal(arch: str, keyword: str | None, hf: Any) -> str | None:
    """Why decoding ``arch`` with a KV cache cannot equal recomputing the whole sequence
    (its base model hands its layers no cache: ``keyword`` None, ``layer_call.cache_keyword``;
    its attention builds its own mask), or None."""
    if keyword is None:
        return (f"model=hf: {arch}'s base model hands its decoder layers no KV cache, so decoding with one "
                "would attend to the new token only")
    from titan_hf.context_parallel import attention_building_its_own_mask

    own = attention_building_its_own_mask(hf)
    if own:  # Doge: its dynamic mask, made from the keys it holds, differs with a cache (measured)
        return (f"model=hf: {arch}'s {own} builds its own attention mask from its keys; decoding with a KV "
                "cache does not reproduce the whole sequence's logits for it")
    return None


def _nested_head(shell: nn.Module, path: str) -> None:
    raise ConfigError(f"model=hf: {type(shell).__name__}'s output embeddings sit at {path}, not on the model itself")


def document_positions(doc_ids: torch.Tensor) -> torch.Tensor:
    """``[B, S]`` positions restarting at 0 where each document starts."""
    index = torch.arange(doc_ids.shape[1], device=doc_ids.device).expand_as(doc_ids)
    starts = torch.ones_like(doc_ids, dtype=torch.bool)
    starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    return index - torch.where(starts, index, 0).cummax(dim=1).values


def build(config: HFModelConfig) -> HFCausalLM:
    return HFCausalLM(config)


def flops(config: HFModelConfig, seq_len: int) -> tuple[int, float]:
    """``(parameters, training FLOPs per token)``: 6 per active non-embedding parameter
    (an MoE's experts count top-k of n) plus attention's 12 * layers * heads * head_dim * seq."""
    with torch.device("meta"):
        model = HFCausalLM(config)
    hf = model.hf_config
    total = sum(p.numel() for p in model.parameters())
    embed = model.tok_embeddings.weight.numel()
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    n_exp = getattr(hf, "num_local_experts", None) or getattr(hf, "num_experts", None)
    top_k = getattr(hf, "num_experts_per_tok", None)
    active = total - embed - (experts - experts * top_k // n_exp if n_exp and top_k else 0)
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    attn = 12 * hf.num_hidden_layers * hf.num_attention_heads * head_dim * seq_len
    return total, float(6 * active + attn)
