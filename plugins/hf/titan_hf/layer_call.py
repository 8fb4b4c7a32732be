"""What a base model's ``forward`` hands each decoder layer, checked against what the
wrapper (``titan_hf.model``) makes: attention masks, positions, rotary embeddings and
the cache. A layer that takes something else from its base model (Beam's NoPE
``attention_scaling``, Gemma 4's ``shared_kv_states``, Mllama's cross-attention
states) cannot be driven layer by layer: one line naming the argument, before launch,
instead of a crash inside a rank or a layer silently run without it.
"""

from __future__ import annotations

import ast
import inspect
import textwrap

from torch import nn

from titan_plugins.errors import ConfigError

__all__ = ["MADE", "cache_keyword", "check_layer_call", "makes_sliding_masks"]

#: keyword arguments the wrapper gives every layer, or that only serve caching / outputs
MADE = frozenset({"attention_mask", "position_embeddings", "position_ids", "cache", "use_cache", "layer_past",
                  "past_key_value", "past_key_values", "cache_position", "output_attentions",
                  "output_router_logits"})


def _layer_calls(source: str) -> list[ast.Call]:
    """The calls inside the forward's ``for`` loops that pass an attention mask or
    position embeddings: the decoder layers' calls."""
    calls = []
    for loop in (n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.For)):
        for node in ast.walk(loop):
            if isinstance(node, ast.Call) and {k.arg for k in node.keywords} & {"attention_mask",
                                                                                 "position_embeddings"}:
                calls.append(node)
    return calls


def check_layer_call(base: nn.Module) -> None:
    """Raise ``ConfigError`` when ``type(base).forward`` hands its layers an argument
    the wrapper does not make; silent when the source cannot be read."""
    cls = type(base)
    try:
        source = textwrap.dedent(inspect.getsource(inspect.unwrap(cls.forward)))
    except (OSError, TypeError):
        return
    extra = sorted({k.arg for call in _layer_calls(source) for k in call.keywords if k.arg} - MADE)
    if extra:
        raise ConfigError(f"model=hf: {cls.__name__}.forward hands its decoder layers {', '.join(extra)}, "
                          "which model=hf does not make (it makes attention masks, positions and rotary "
                          "embeddings): its forward cannot be driven layer by layer")


_CACHE_KEYWORDS = ("cache", "past_key_values", "past_key_value", "layer_past")


def cache_keyword(base: nn.Module) -> str | None:
    """The keyword ``type(base).forward`` hands its layers the KV cache with (``cache``
    in transformers 5; GPT-NeoX and Falcon say ``layer_past``, and a layer given the cache
    under another name drops it into ``**kwargs``: decoding then attends to the new token
    only). ``None`` when its layers take no cache; ``"cache"`` when the source cannot be read."""
    try:
        source = textwrap.dedent(inspect.getsource(inspect.unwrap(type(base).forward)))
    except (OSError, TypeError):
        return "cache"
    passed = {k.arg for call in _layer_calls(source) for k in call.keywords}
    return next((name for name in _CACHE_KEYWORDS if name in passed), None)


def makes_sliding_masks(base: nn.Module) -> bool:
    """Whether ``type(base).forward`` builds sliding-window masks at all (a config may
    carry ``sliding_window`` that its forward never uses: Youtu masks every layer fully);
    ``True`` when the source cannot be read."""
    try:
        source = inspect.getsource(inspect.unwrap(type(base).forward))
    except (OSError, TypeError):
        return True
    return "sliding_window_causal_mask" in source
