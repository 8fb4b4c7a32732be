"""What a plugin hands over: `ModelSpec`, `PipelineInfo` and `DatasetSpec`.

Everything heavy is referenced as a ``"package.module:attribute"`` string and
resolved only when a model is chosen, so registering a model imports no torch.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

Ref = str  # "package.module:attribute.path"


def resolve(ref: Ref | Any) -> Any:
    """Import and return the object a ``"module:attr"`` reference names.

    Non-string values are returned as they are, so specs may also carry objects
    directly (handy in tests).
    """
    if not isinstance(ref, str):
        return ref
    module_name, sep, attr_path = ref.partition(":")
    if not sep or not module_name or not attr_path:
        raise ValueError(f"reference {ref!r} is not of the form 'package.module:attribute'")
    obj: Any = importlib.import_module(module_name)
    for part in attr_path.split("."):
        obj = getattr(obj, part)
    return obj


@dataclass(frozen=True, kw_only=True)
class PipelineInfo:
    """How the core splits a model into pipeline stages.

    The model keeps its blocks in an ``nn.ModuleDict`` named ``layers_attr`` keyed
    by ``"0" .. "n-1"``; the split keeps a contiguous range of them per stage.
    ``first_stage_modules`` live only on the first stage and ``last_stage_modules``
    only on the last; on other stages those attributes are set to ``None`` and the
    model's forward, ``init_weights``, TP plan and FSDP wrap must tolerate that.

    ``stage_inputs`` names a model method ``(tokens) -> dict[str, Tensor]`` for what
    every stage's forward needs besides the previous stage's output, such as the
    document ids of a block-causal attention mask (later stages see hidden states,
    not token ids). Under PP the trainer calls it on the step's token ids and passes
    the result to every stage's ``forward`` as keyword arguments; tensors must be
    batch-first (the schedule splits them into microbatches with the tokens).
    Without PP the model's own ``forward(tokens)`` derives them itself.
    """

    layers_attr: str = "layers"
    first_stage_modules: tuple[str, ...] = ("tok_embeddings",)
    last_stage_modules: tuple[str, ...] = ("norm", "output")
    stage_inputs: str | None = None


@dataclass(frozen=True, kw_only=True)
class Capabilities:
    """Which parallelisms the parallelize hook implements (checked before launch).

    ``cp``: the model runs under context parallelism: its attention goes through
    ``titan_plugins.components.attention.attend`` (or the masks and helpers of
    ``components.cp_attention``), its rotary table through ``cp_attention.rope_rows``.
    """

    fsdp: bool = True
    tp: bool = False
    ep: bool = False
    pp: bool = False
    cp: bool = False


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """A model a plugin registers through ``titan_register_models``.

    Attributes:
        name: registry name, used as ``model=<name>`` on the command line.
        config: the schema, an OmegaConf-compatible dataclass (no Callable or
            Literal fields; Enums instead). Its field defaults are not used for
            training: a flavor provides every value and overrides go on top.
        flavors: a mapping ``flavor name -> instance of config``.
        default_flavor: the flavor used when ``model.flavor`` is not given.
        build: ``build(config) -> nn.Module``; must work under ``torch.device("meta")``.
            The module provides ``init_weights(buffer_device=None)``.
        parallelize: ``parallelize(model, parallel_dims, job_config) -> nn.Module``
            applying TP, EP, activation checkpointing, compile and FSDP in that order.
        pipeline: how to split the model into stages; ``None`` if PP is unsupported.
        validate: ``validate(config, parallelism) -> None``; raises
            ``titan_plugins.errors.ConfigError`` naming the two numbers that disagree.
        state_dict_adapter: a class with ``to_torchtitan(sd)`` / ``from_torchtitan(sd)``
            (and optionally ``to_hf`` / ``from_hf``), constructed with the config.
            ``to_hf(sd)`` / ``from_hf(sd)`` map parameter names (and fused/split
            tensors) between the model's state dict and a Hugging Face checkpoint,
            both ways; the core uses them for ``model.hf`` loads and ``titan-export``.
        config_from_hf: ``config_from_hf(hf_config: dict) -> dict`` returns values for
            ``config`` (nested dicts for nested dataclasses) built from a Hugging Face
            ``config.json``; they go on top of the chosen flavor, overrides on top of
            them. A field the plugin cannot honour raises
            ``titan_plugins.errors.ConfigError`` as
            ``config.json: <field>=<value>: <why>``; meaningful fields are never
            silently dropped. Needed for ``model.hf=PATH``.
        config_to_hf: ``config_to_hf(config) -> dict`` returns a ``config.json`` dict
            (with ``architectures`` and ``model_type``) that transformers 5.x loads.
            Needed for ``titan-export``.
        verify: ``verify(spec, config, folder, inputs, labels, *, forced) -> str | None``:
            before launch (``model.verify``), the model built from ``model.hf``'s first
            layers against a reference implementation of the same folder on one batch
            of the run's own data; returns the header's line, ``None`` when it chose
            not to run (``forced=False``: ``model.verify`` left at auto and the
            architecture already proven), or raises ``ConfigError`` naming the worst tensor.
        check_decoding: ``check_decoding(config) -> None``; raises ``ConfigError`` (one line)
            where the model cannot decode with a KV cache as it computes whole sequences.
            Called before launch when the run samples from the policy (an online objective
            with ``rollout=native``); absent: the model is taken to decode correctly.
        flops: ``flops(config, seq_len) -> (num_params, flops_per_token)``.
        optimizer_hooks: ``optimizer_hooks(model_parts, parallel_dims) -> list[Callable[[], None]]``,
            run before every optimizer step (MoE load balancing lives here).
        capabilities: the parallelisms the parallelize hook supports.
        description: one line for ``titan-plugins list``.
        rank_imports: modules every rank of this model imports that the core does not
            (``transformers`` for ``model=hf``): the launcher's fork server imports them
            once and the ranks fork from it, instead of each rank importing them again
            (seconds of CPU per rank). Names only; a module that fails to import here is
            imported, and reported, by the rank itself.
    """

    name: str
    config: Ref | type
    flavors: Ref | Mapping[str, Any]
    build: Ref
    parallelize: Ref
    default_flavor: str = "debugmodel"
    pipeline: PipelineInfo | None = None
    validate: Ref | None = None
    state_dict_adapter: Ref | None = None
    flops: Ref | None = None
    optimizer_hooks: Ref | None = None
    config_from_hf: Ref | None = None
    config_to_hf: Ref | None = None
    verify: Ref | None = None
    check_decoding: Ref | None = None
    capabilities: Capabilities = field(default_factory=Capabilities)
    description: str = ""
    rank_imports: tuple[str, ...] = ()

    def load(self, attribute: str) -> Any:
        """Resolve one of the reference attributes (``"build"``, ``"flavors"``, ...)."""
        value = getattr(self, attribute)
        return None if value is None else resolve(value)

    def flavor_names(self) -> list[str]:
        return list(self.load("flavors"))

    def flavor(self, name: str) -> Any:
        from titan_plugins.errors import ConfigError

        flavors = self.load("flavors")
        if name not in flavors:
            raise ConfigError(
                f"model.flavor={name!r} is not a flavor of model {self.name!r} "
                f"(choose from: {', '.join(flavors)})"
            )
        return flavors[name]


@dataclass(frozen=True, kw_only=True)
class DatasetSpec:
    """A dataset a plugin registers through ``titan_register_datasets``.

    ``build(data_config, tokenizer, dp_rank, dp_world, seq_len, seed)`` returns an
    iterable of ``(input_ids, labels)`` int64 tensors of length ``seq_len`` with
    ``state_dict()`` / ``load_state_dict()`` so runs resume where they stopped.

    ``check(data_config)`` (optional) raises ``ConfigError`` in one line for a source
    that cannot be read (missing files, a glob matching nothing, bad weights); the
    launcher calls it before any rank starts (``titan_plugins.train.prelaunch``).
    """

    name: str
    build: Ref
    description: str = ""
    check: Ref | None = None
