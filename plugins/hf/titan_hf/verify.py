"""``model.verify`` for ``model=hf``: the folder's first layers through this plugin's
model and through transformers' own, on one batch of the run's data.

Both sides are fp32, on CPU, with the same attention kernel, built from the same
folder truncated to ``LAYERS`` decoder layers (transformers reads its first layers;
ours loads them with ``hf_partial``). Tolerances: the loss within ``LOSS_TOL``
(absolute) and every parameter's gradient norm within ``GRAD_TOL`` (relative to the
larger of the two, and ``GRAD_FLOOR`` absolute for vanishing gradients): float
reordering between two implementations of the same maths stays orders of magnitude
below them, a weight left at random, a missed scale or a wrong mask does not.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F

from titan_plugins.errors import ConfigError

__all__ = ["GRAD_TOL", "LAYERS", "LOSS_TOL", "compare", "verify"]

LAYERS = 2
LOSS_TOL = 1e-4
GRAD_TOL = 1e-3
GRAD_FLOOR = 1e-6


def _loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100)


def compare(ours: torch.nn.Module, theirs: torch.nn.Module, renames: tuple[tuple[str, str], ...],
            inputs: torch.Tensor, labels: torch.Tensor) -> dict[str, Any]:
    """Loss and per-parameter gradient norms of both models on one batch: ``{"loss":
    (ours, theirs), "worst": (name, ours, theirs, relative), "grads": n}``."""
    from titan_hf.state_dict_adapter import to_hf_name

    ours.train()
    theirs.train()
    packed = {}
    if getattr(ours, "block_causal", False):  # documents: transformers' packed path, as ours runs it
        from titan_hf.model import document_positions
        from titan_plugins.components.attention_masks import document_ids

        # (no cache: transformers detects packed rows from position_ids only without one)
        packed = {"position_ids": document_positions(document_ids(inputs, ours.eos_id)), "use_cache": False}
    # both forwards from the same random state: a model that samples in training (PhiMoE's
    # experts, transformers' default router_jitter_noise) draws the same numbers on both sides
    with torch.random.fork_rng(devices=[inputs.device] if inputs.device.type == "cuda" else []):
        mine = _loss(ours(inputs), labels)
    ref = _loss(theirs(inputs, **packed).logits, labels)
    mine.backward()
    ref.backward()
    their_params = dict(theirs.named_parameters(remove_duplicate=False))
    worst: tuple[str, float, float, float] = ("", 0.0, 0.0, -1.0)
    count = 0
    for name, p in ours.named_parameters():
        other = their_params.get(to_hf_name(name, renames))
        if other is None:
            raise ConfigError(f"model.verify: transformers' model has no parameter for {name} "
                              f"({to_hf_name(name, renames)})")
        a = float(p.grad.norm()) if p.grad is not None else 0.0
        b = float(other.grad.norm()) if other.grad is not None else 0.0
        rel = abs(a - b) / max(a, b) if max(a, b) > GRAD_FLOOR else 0.0
        count += 1
        if rel > worst[3]:
            worst = (name, a, b, rel)
    return {"loss": (float(mine.detach()), float(ref.detach())), "worst": worst, "grads": count}


def verify(spec: Any, config: Any, folder: str, inputs: torch.Tensor, labels: torch.Tensor, *,
           forced: bool) -> str | None:
    """``ModelSpec.verify``: raises ``ConfigError`` naming the worst tensor on a miss."""
    import transformers
    from transformers import AutoModelForCausalLM

    from titan_hf.config import TESTED
    from titan_hf.model import build, hf_config_object
    from titan_plugins.hf.load import load_hf_weights

    if not forced and config.architecture in TESTED:
        return None  # proven on every layout by this repository's tests
    layers = min(LAYERS, int(config.n_layers))
    small = dataclasses.replace(config, n_layers=layers)
    torch.manual_seed(0)
    ours = build(small)
    with torch.no_grad():
        ours.init_weights()
    load_hf_weights([ours], spec, small, folder, verbose=False, partial=True)
    ours.float()
    hf = hf_config_object(small)
    theirs = AutoModelForCausalLM.from_pretrained(folder, config=hf, dtype=torch.float32,
                                                  attn_implementation=hf._attn_implementation)
    result = compare(ours, theirs, ours.structure.renames(), inputs, labels)
    (a, b), (name, ga, gb, rel) = result["loss"], result["worst"]
    where = f"{config.architecture}, first {layers} of {config.n_layers} layers of {folder}"
    if abs(a - b) > LOSS_TOL or rel > GRAD_TOL:
        raise ConfigError(
            f"model.verify: model=hf differs from transformers {transformers.__version__} on {where}: loss {a:.6g} vs "
            f"{b:.6g}; worst gradient {name} norm {ga:.4g} vs {gb:.4g} (model.verify=false trains it anyway)")
    return (f"against transformers {transformers.__version__} ({where}): loss {a:.6g}, difference {abs(a - b):.1e}; "
            f"{result['grads']} gradient norms within {rel:.1e}")
