"""``Session``: what the checks of one target share, held explicitly.

A check takes a ``Target`` (it then opens a session of its own) or a ``Session``
(checks run on one session share its plugin manager, composed job, initialised
models and the results of the batched subprocess runs). ``ConformanceSuite`` keeps
one session per test class, so no check depends on another having run first and
nothing is cached at module level.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

from titan_plugins.testing.conformance.contract import ContractError, one_line
from titan_plugins.testing.conformance.target import Target

if TYPE_CHECKING:
    from omegaconf import DictConfig
    from torch import nn

    from titan_plugins.plugins import PluginInfo, TitanPluginManager
    from titan_plugins.spec import ModelSpec

__all__ = ["Initialised", "Outcome", "Session", "open_session"]

# A batched check's result per case: None (holds), a skip reason, or the broken contract.
Outcome = ContractError | str | None


class Initialised(NamedTuple):
    """The model materialized as the core does it (meta -> to_empty -> init_weights)
    with seed 0 and with seed 1, after the init-weights contract held."""

    seed0: nn.Module
    seed1: nn.Module


@dataclass(eq=False)
class Session:
    """The target, its plugin manager and spec, the composed job and model config
    (on first use), and what expensive checks computed (``initialised``, the
    per-case ``outcomes`` of the subprocess runs, their ``workdir``)."""

    target: Target
    pm: TitanPluginManager
    spec: ModelSpec
    owner: PluginInfo
    initialised: Initialised | None = None
    outcomes: dict[str, Outcome] = field(default_factory=dict)
    workdir: str | None = None
    _job: DictConfig | None = None
    _config: Any = None
    _derived: dict[str, Session] = field(default_factory=dict)

    @classmethod
    def open(cls, target: Target) -> Session:
        """Load the plugins (installed ones plus ``target.plugins``) and find the model."""
        from titan_plugins.errors import TitanError
        from titan_plugins.plugins import get_plugin_manager

        pm = get_plugin_manager()
        missing = [m for m in target.plugins if m not in pm.infos]
        if missing:
            pm.load_modules(missing)
        try:
            spec = pm.get_model(target.model)
            owner = pm.model_owner(target.model)
        except TitanError as exc:
            errors = "; ".join(pm.errors)
            raise ContractError(
                "registration",
                f"{exc}" + (f" (plugin load errors: {errors})" if errors else ""),
                "install your distribution (pip install -e .) so its 'titan_plugins' entry point is "
                "visible, and register a ModelSpec with this name in titan_register_models",
            ) from None
        return cls(target=target, pm=pm, spec=spec, owner=owner)

    # ---------------------------------------------------------- composition
    def _compose(self) -> None:
        from titan_plugins.config import hydra_glue

        target = self.target
        try:
            cfg = hydra_glue.compose([f"model={target.model}", *target.overrides], self.pm)
            _, job = hydra_glue.resolve_job(cfg, self.pm)
            config = hydra_glue.model_config(job.model, self.spec)
        except Exception as exc:
            raise ContractError(
                "hydra-compose",
                f"model={target.model} {' '.join(target.overrides)} does not compose: {one_line(exc)}",
                "check the overrides and conf/model/<name>.yaml (it starts from "
                "/schema/model/<name>@_here_); run `titan-run model=<name> --cfg job` to see the error",
            ) from None
        self._job, self._config = job, config

    @property
    def job(self) -> DictConfig:
        """The composed, resolved job (composed on first use)."""
        if self._job is None:
            self._compose()
        return self._job

    @property
    def config(self) -> Any:
        """The model config: an instance of the plugin's schema."""
        if self._job is None:
            self._compose()
        return self._config

    def for_kind(self, kind: str) -> Session:
        """The session of ``target.for_kind(kind)`` (its own job), sharing the plugins."""
        target = self.target.for_kind(kind)
        if target is self.target:
            return self
        if kind not in self._derived:
            self._derived[kind] = dataclasses.replace(
                self, target=target, initialised=None, outcomes={}, _job=None, _config=None, _derived={})
        return self._derived[kind]

    # ---------------------------------------------------------------- model
    def build_meta(self) -> nn.Module:
        """``build(config)`` under ``torch.device("meta")``."""
        import torch

        build = self.spec.load("build")
        config = self.config
        with torch.device("meta"):
            return build(config)

    def materialize(self, seed: int, *, poison: bool = False) -> nn.Module:
        """The model as the core makes it: meta build -> to_empty -> seeded init_weights.
        ``poison`` fills every floating tensor with NaN before init_weights."""
        import torch

        model = self.build_meta()
        model.to_empty(device="cpu")
        if poison:
            with torch.no_grad():
                for tensor in [*model.parameters(), *model.buffers()]:
                    if tensor.is_floating_point() or tensor.is_complex():
                        tensor.fill_(float("nan"))
        torch.manual_seed(seed)
        with torch.no_grad():
            model.init_weights(buffer_device=torch.device("cpu"))
        return model

    def vocab_size(self, model: nn.Module) -> int:
        vocab = getattr(self.config, "vocab_size", None)
        if vocab is None:
            vocab = getattr(getattr(model, "tok_embeddings", None), "num_embeddings", None)
        if vocab is None:
            raise ContractError("forward-backward", "cannot tell the vocabulary size",
                                "give the schema a vocab_size field or the model a tok_embeddings embedding")
        return int(vocab)

    def seq_len(self, limit: int = 16) -> int:
        """The training seq_len, capped at ``limit`` and the model's ``max_seq_len``."""
        seq = min(int(self.job.training.seq_len), limit)
        max_seq = getattr(self.config, "max_seq_len", None)
        return min(seq, int(max_seq)) if max_seq else seq


def open_session(target: Target | Session) -> Session:
    """``target`` itself when it is a session, else a new session of it."""
    return target if isinstance(target, Session) else Session.open(target)
