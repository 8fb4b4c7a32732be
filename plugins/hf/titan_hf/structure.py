"""Where a transformers causal LM keeps its parts, read from what the model declares.

No module name is assumed: the embeddings are ``get_input_embeddings()``, the head
``get_output_embeddings()``, the decoder layers the ``nn.ModuleList`` of the base model
whose blocks are the architecture's ``_no_split_modules``, the final norm the entry
after the layers in ``base_model_pp_plan`` (else the one remaining base-model child
with weights), and the rotary embedding the base model's child holding ``*inv_freq``.
A model whose base holds weights none of these account for (learned positions, a
second embedding, state-space blocks) cannot be driven layer by layer: one line.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from titan_plugins.errors import ConfigError

__all__ = ["Structure", "find_structure"]


@dataclass(frozen=True)
class Structure:
    """Paths (FQNs in the transformers model) of each part; ``rotary`` may be ``None``."""

    base: str  # base_model_prefix ("model", "transformer", ...)
    embeddings: str  # e.g. "model.embed_tokens"
    layers: str  # e.g. "model.layers"
    norm: str  # e.g. "model.norm"
    head: str  # e.g. "lm_head"
    rotary: str | None  # e.g. "model.rotary_emb"

    def renames(self) -> tuple[tuple[str, str], ...]:
        """``(ours, theirs)`` name prefixes: the core's names for the hoisted modules."""
        return (("tok_embeddings.", f"{self.embeddings}."), ("layers.", f"{self.layers}."),
                ("norm.", f"{self.norm}."), ("output.", f"{self.head}."))


def _has_weights(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def _weightless_norm(base: nn.Module, name: str, accounted: set[int]) -> bool:
    child = getattr(base, name)
    return (id(child) not in accounted and not _has_weights(child) and not any(True for _ in child.buffers())
            and not isinstance(child, (nn.Dropout, nn.ModuleList, nn.ModuleDict, nn.Identity)))


def find_structure(shell: nn.Module) -> Structure:
    """The parts of ``shell`` (an ``AutoModelForCausalLM``, meta is fine)."""
    arch = type(shell).__name__
    prefix = getattr(shell, "base_model_prefix", "")
    base = getattr(shell, prefix, None) if prefix else None
    embeddings, head = shell.get_input_embeddings(), shell.get_output_embeddings()
    if not isinstance(base, nn.Module):  # a prefix naming no child (Llama 4 text): the child holding the embeddings
        holders = [(n, c) for n, c in shell.named_children() if any(m is embeddings for m in c.modules())]
        prefix, base = holders[0] if len(holders) == 1 else (prefix, None)
    if not isinstance(base, nn.Module):
        raise ConfigError(f"model=hf: {arch} has no base model under base_model_prefix={prefix!r}")
    paths = {id(m): n for n, m in shell.named_modules()}
    if head is None or id(head) not in paths:
        raise ConfigError(f"model=hf: {arch} declares no output embeddings (get_output_embeddings): not a language-model head")
    blocks = set(getattr(shell, "_no_split_modules", None) or ())
    layer_lists = [name for name, child in base.named_children() if isinstance(child, nn.ModuleList)
                   and len(child) and all(type(b).__name__ in blocks for b in child)]
    if len(layer_lists) != 1:
        raise ConfigError(f"model=hf: {arch}'s base model has {len(layer_lists)} lists of its _no_split_modules "
                          f"blocks ({', '.join(sorted(blocks)) or 'none declared'}); model=hf drives exactly one")
    layers = layer_lists[0]
    pp_plan = list(getattr(base, "_pp_plan", None) or getattr(shell, "base_model_pp_plan", None)
                   or getattr(type(base), "base_model_pp_plan", None) or {})
    accounted = {id(embeddings), id(getattr(base, layers))}
    after = pp_plan[pp_plan.index(layers) + 1:] if layers in pp_plan else []
    norms = [n for n in after if _has_weights(getattr(base, n))]
    if not pp_plan:  # no pipeline plan declared: the one base child with weights left over
        norms = [n for n, c in base.named_children() if id(c) not in accounted and _has_weights(c)]
        if len(norms) > 1:
            raise ConfigError(f"model=hf: {arch}'s base model holds weights outside its embeddings and layers "
                              f"({', '.join(norms)}) and declares no pipeline plan saying which is the final norm: "
                              "its forward cannot be driven layer by layer")
    if not norms:  # a final norm without weights (OLMo's LayerNorm, NanoChat's RMSNorm): the one left over
        norms = [n for n in (after or [n for n, _ in base.named_children()]) if _weightless_norm(base, n, accounted)]
    if len(norms) != 1:
        raise ConfigError(f"model=hf: {arch}'s final norm is not declared (base_model_pp_plan after "
                          f"{layers!r}: {after or 'nothing'}); model=hf needs exactly one")
    norm = norms[0]
    accounted.add(id(getattr(base, norm)))
    rotary = [n for n, c in base.named_children()  # inv_freq, or one per layer type (Gemma 3)
              if not _has_weights(c) and any(b.endswith("inv_freq") for b, _ in c.named_buffers())]
    extra = [n for n, c in base.named_children() if id(c) not in accounted and _has_weights(c)]
    if extra:
        raise ConfigError(f"model=hf: {arch}'s base model holds weights outside its embeddings, layers and final "
                          f"norm ({', '.join(extra)}): its forward cannot be driven layer by layer")
    if len(rotary) > 1:
        raise ConfigError(f"model=hf: {arch} has {len(rotary)} rotary embeddings ({', '.join(rotary)})")
    return Structure(base=prefix, embeddings=paths[id(embeddings)], layers=f"{prefix}.{layers}",
                     norm=f"{prefix}.{norm}", head=paths[id(head)],
                     rotary=f"{prefix}.{rotary[0]}" if rotary else None)


def get(shell: nn.Module, path: str) -> Any:
    return shell.get_submodule(path)
