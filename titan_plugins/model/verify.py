"""``model.verify``: before launch, prove the model a folder builds against the plugin's
reference implementation (``ModelSpec.verify``; for ``model=hf``, transformers itself).

One batch of the run's own data (its tokenizer, its first row, at most
``VERIFY_TOKENS`` tokens) goes through the model built from ``model.hf``'s first layers
and through the reference; the plugin compares the losses and every gradient's norm.
A miss is one line naming the worst tensor, before any rank starts; a match is a line
in the run header (``model.verified``). It checks the model (structure, weights,
forward) unsharded, in the launching process: that parallel layouts equal one rank is
the parity suite's and ``titan-compare``'s job.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from titan_plugins.errors import ConfigError

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from titan_plugins.spec import ModelSpec

__all__ = ["VERIFY_TOKENS", "first_batch", "verify_model"]

VERIFY_TOKENS = 128
_DONE: dict[str, str | None] = {}  # a launch prepares its job more than once: check once


def first_batch(job: DictConfig, datasets: Any, vocab_size: int | None) -> tuple[torch.Tensor, torch.Tensor, str]:
    """``(inputs, labels, what)``: the first row of the run's data (one row, at most
    ``VERIFY_TOKENS`` positions); synthetic data gives seeded ids within the vocabulary."""
    from titan_plugins.data import build_dataloader, build_tokenizer

    seq = min(int(job.training.seq_len), VERIFY_TOKENS)
    if job.data.name == "synthetic":
        vocab = int(job.data.vocab_size or vocab_size or 256)
        ids = torch.randint(0, vocab, (1, seq + 1), generator=torch.Generator().manual_seed(int(job.training.seed)))
        return ids[:, :-1], ids[:, 1:], f"{seq} synthetic tokens"
    loader = build_dataloader(job.data, build_tokenizer(job.data), dp_rank=0, dp_world=1, local_batch_size=1,
                              seq_len=seq, seed=int(job.training.seed), datasets=datasets, grad_accum_steps=1)
    batch = next(iter(loader))
    return batch[0][:1], batch[1][:1], f"{seq} tokens of data.name={job.data.name}"


def verify_model(spec: ModelSpec, job: DictConfig, config: Any, datasets: Any) -> str | None:
    """Run the plugin's check when ``model.verify`` asks (or, left at null, when the
    plugin wants it); returns the header's line (``None``: not run)."""
    mode = job.model.get("verify")
    check = spec.load("verify")
    folder = job.model.get("hf")
    if mode is False or not folder:
        return None
    if check is None:
        if mode:
            raise ConfigError(f"model.verify=true: model {spec.name!r} declares no reference to verify against")
        return None
    import json

    from omegaconf import OmegaConf

    key = json.dumps([OmegaConf.to_container(job.model, resolve=True), OmegaConf.to_container(job.data, resolve=True),
                      int(job.training.seq_len)], sort_keys=True, default=str)
    if key not in _DONE:
        inputs, labels, what = first_batch(job, datasets, getattr(config, "vocab_size", None))
        line = check(spec, config, folder, inputs, labels, forced=bool(mode))
        _DONE[key] = None if line is None else f"{line}, on {what}"
    return _DONE[key]
