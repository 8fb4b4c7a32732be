"""``model=hf`` under context parallelism (``parallelism.cp``), through transformers'
own attention interface.

Under CP each rank holds the core's load-balanced chunks of every row
(``titan_plugins.components.cp_attention``). Three things then differ from one rank:

- **positions**: the rotary embeddings take the global positions of the rank's tokens
  (restarting per document on packed rows), computed over the whole row;
- **masks**: a boolean ``[B or 1, 1, S / cp, S]`` mask per layer kind (full, sliding),
  the local queries' global positions against every key of the row, documents from the
  whole row's ids; built here, not by transformers' mask builders, which only know
  local positions;
- **attention**: :data:`ATTENTION`, registered in transformers' ``AttentionInterface``,
  all-gathers the keys and values over the cp group (``SequenceShard.gather``: its
  backward sends each rank its keys' gradients) and hands them to transformers' own
  ``sdpa_attention_forward`` (GQA, scaling, dropout as the architecture declares them).
  With no shard in flight it is that SDPA function unchanged.

So any architecture whose attention goes through the interface with SDPA gets CP
without its own code; one that runs eager only (soft-capped attention logits, sinks)
is refused in one line before launch (:func:`check_cp`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from titan_plugins.components.cp_attention import SequenceShard, current_shard
from titan_plugins.errors import ConfigError

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = ["ATTENTION", "check_cp", "sharded_positions_and_masks", "use_cp_attention"]

ATTENTION = "titan_cp_sdpa"


def cp_sdpa_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: Any, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' SDPA attention over the whole row's keys and values (gathered over
    the cp group) for this rank's queries; plain SDPA when no shard is in flight."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    shard = current_shard()
    if shard is not None:
        if key.shape[2] != shard.local_len:
            raise ValueError(f"context parallel: attention over {key.shape[2]} keys, but this rank holds "
                             f"{shard.local_len} positions (decoding with a KV cache does not run under cp)")
        if attention_mask is not None and attention_mask.shape[-1] != shard.seq_len:
            raise ValueError(f"context parallel: {type(module).__name__} hands its attention a mask over "
                             f"{attention_mask.shape[-1]} keys, not the row's {shard.seq_len}: it builds its own mask "
                             "from this rank's keys and cannot run under cp")
        key, value = shard.gather(key, 2), shard.gather(value, 2)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def use_cp_attention(model: nn.Module) -> None:
    """Register :data:`ATTENTION` (its masks are SDPA's) and make every config of
    ``model`` that names an attention kernel use it."""
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    from transformers.modeling_utils import AttentionInterface

    AttentionInterface.register(ATTENTION, cp_sdpa_attention)
    AttentionMaskInterface.register(ATTENTION, sdpa_mask)  # what a forward without a shard builds
    _set_attention(model, ATTENTION)
    shell = getattr(model, "_shell", None)  # the hoisted modules' former owner holds the same config
    if shell is not None:
        shell.config._attn_implementation = ATTENTION


def _set_attention(model: nn.Module, name: str) -> None:
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "_attn_implementation"):
            config._attn_implementation = name


def sharded_positions_and_masks(shard: SequenceShard, kinds: set[str], sliding_window: int | None,
                                doc_ids: torch.Tensor | None,
                                device: torch.device) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``(positions [1 or B, S / cp], {kind: mask [1 or B, 1, S / cp, S]})`` of this
    rank's tokens: global positions (per document where ``doc_ids``, this rank's ids
    of each token's document, are given), masks True where a query may attend."""
    import torch

    from titan_hf.model import document_positions

    q = shard.positions(device)
    keys = torch.arange(shard.seq_len, device=device)
    allowed = q.view(1, -1, 1) >= keys.view(1, 1, -1)  # [1, S/cp, S]
    if doc_ids is None:
        positions = q.unsqueeze(0)
    else:
        whole = shard.gather_ids(doc_ids)  # [B, S]
        positions = document_positions(whole).index_select(1, q)
        allowed = allowed & (whole.index_select(1, q).unsqueeze(2) == whole.unsqueeze(1))
    masks = {}
    for kind in kinds:
        mask = allowed
        if kind == "sliding_attention":  # transformers' sliding_window_overlay: kv > q - window
            mask = mask & (keys.view(1, 1, -1) > q.view(1, -1, 1) - int(sliding_window))
        masks[kind] = mask.unsqueeze(1)
    return positions, masks


def check_cp(hf: Any, cp: int) -> None:
    """Refuse (one line) what context parallelism cannot run: ``hf`` is transformers'
    config with the attention kernel the job resolved (``titan_hf.model.hf_config_object``)."""
    from titan_hf.architecture import causal_lm_class

    cls = causal_lm_class(hf.model_type)
    if not getattr(cls, "_supports_sdpa", False):
        raise ConfigError(f"parallelism.cp={cp}: transformers runs {cls.__name__} without SDPA (its attention "
                          "needs eager: soft-capped logits, sinks or a kernel of its own); context parallel runs "
                          "SDPA over the gathered keys")
    if hf._attn_implementation != "sdpa":
        raise ConfigError(f"model.attn_implementation={hf._attn_implementation} with parallelism.cp={cp}: context "
                          "parallel runs SDPA over the gathered keys; use model.attn_implementation=auto or sdpa")
    if getattr(hf, "attn_logit_softcapping", None) is not None:
        raise ConfigError(f"parallelism.cp={cp}: config.json: attn_logit_softcapping="
                          f"{hf.attn_logit_softcapping}: soft-capped attention does not run under cp")
    own_mask = attention_building_its_own_mask(hf)
    if own_mask:
        raise ConfigError(f"parallelism.cp={cp}: {cls.__name__}'s {own_mask} does not hand its attention the mask "
                          "it is given but one it builds from its own keys (a rank holds a shard of them); "
                          "context parallel cannot run it")


_PROBE = "titan_cp_probe"


def attention_building_its_own_mask(hf: Any) -> str | None:
    """The class name of an attention module that calls transformers' attention
    interface with a mask other than the one its decoder layer was given (Doge's dynamic
    mask, made from its local keys), found by one forward of a small copy of the model.
    ``None`` when every call passes its layer's mask on, or the small copy does not run
    (the attention function then refuses a mask of the wrong width at step 1)."""
    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    from transformers.modeling_utils import AttentionInterface

    from titan_hf.structure import find_structure
    from titan_hf.tp_plan import tiny_copy

    given: list[Any] = [None]  # the mask the running decoder layer was called with
    foreign: list[str] = []

    def probe(module, query, key, value, attention_mask, **kwargs):
        if attention_mask is not given[0]:
            foreign.append(type(module).__name__)
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    def remember(_layer, args, kwargs):
        given[0] = kwargs.get("attention_mask")

    try:
        tiny = tiny_copy(hf)
        layers = tiny.get_submodule(find_structure(tiny).layers)
    except Exception:  # noqa: BLE001 - no small copy: the runtime check in cp_sdpa_attention stands
        return None
    AttentionInterface.register(_PROBE, probe)
    AttentionMaskInterface.register(_PROBE, sdpa_mask)
    _set_attention(tiny, _PROBE)
    hooks = [layer.register_forward_pre_hook(remember, with_kwargs=True) for layer in layers]
    ids = torch.randint(3, int(tiny.config.vocab_size), (1, 12), generator=torch.Generator().manual_seed(1))
    try:
        with torch.no_grad():
            tiny(input_ids=ids)
    except Exception:  # noqa: BLE001 - as above
        return None
    finally:
        for hook in hooks:
            hook.remove()
    return foreign[0] if foreign else None
