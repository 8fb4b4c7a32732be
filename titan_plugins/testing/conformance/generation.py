"""The generation contract: cached and uncached greedy decoding agree (one process).
The decoding itself is ``titan_plugins.testing.generation.check_kv_cache``."""

from __future__ import annotations

from titan_plugins.testing.conformance.contract import CheckResult, ContractError
from titan_plugins.testing.conformance.session import Session, open_session
from titan_plugins.testing.conformance.target import Target

__all__ = ["check_generation"]


def check_generation(target: Target | Session) -> CheckResult:
    """The kit's ``generation`` contract: a model whose ``forward`` takes ``cache=``
    decodes the same greedy tokens with and without the KV cache. Skips (returns the
    reason) when the model does not declare generation support."""
    from titan_plugins.generate import supports_generation
    from titan_plugins.testing.generation import check_kv_cache

    session = open_session(target)
    model = session.materialize(0)
    if not supports_generation(model):
        return f"{type(model).__name__}.forward takes no cache=: generation not declared"
    vocab = int(session.config.vocab_size)
    try:
        check_kv_cache(model, vocab, prompt_len=5, new_tokens=6)
    except AssertionError as exc:
        raise ContractError("generation", str(exc), "with cache=, run only the new tokens at positions "
                            "cache.pos.. and attend to cache.layer(name).update(k, v) under "
                            "cache.layer(name).attention_mask(...) (docs/writing-a-plugin.md)") from None
    return None
