"""What the core calls on a plugin's model and state-dict adapter, as ``typing.Protocol``s.

TorchTitan keeps the same contract in ``protocols/model.py`` and
``protocols/state_dict_adapter.py``. These are structural: a plugin never inherits
from them. ``runtime_checkable`` protocols check that the methods exist (not their
signatures); ``titan_plugins.generate.sampling.supports_generation`` checks the one
optional keyword, ``cache=``.

Torch-free at import (``titan-plugins list`` imports this package).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

    from titan_plugins.generate.kv_cache import KVCache

__all__ = ["DecodingModel", "HFStateDictAdapter", "ModelProtocol", "StateDictAdapter"]

StateDict = dict[str, Any]


@runtime_checkable
class ModelProtocol(Protocol):
    """The ``nn.Module`` that ``ModelSpec.build(config)`` returns (built on meta).

    Lifecycle: build -> (pipeline split) -> parallelize -> ``to_empty`` ->
    ``init_weights(buffer_device)``. Modules a pipeline stage does not own are None.
    """

    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        """TorchTitan's init scheme; rebuilds non-persistent buffers on ``buffer_device``."""
        ...

    def forward(self, tokens: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        """Ids ``[B, S]`` (first stage) or hidden states; logits ``[B, S, V]`` on the last
        stage. A model that supports generation also accepts ``cache=`` (a ``KVCache``)."""
        ...


class DecodingModel(ModelProtocol, Protocol):
    """A model whose ``forward`` takes ``cache=``: ``titan-run generate`` needs it."""

    def forward(self, tokens: torch.Tensor, *args: Any, cache: KVCache | None = None) -> torch.Tensor: ...


@runtime_checkable
class StateDictAdapter(Protocol):
    """``ModelSpec.state_dict_adapter``: constructed with the model config; maps this
    plugin's parameter names to and from TorchTitan's (a checkpoint loads as is)."""

    def to_torchtitan(self, state_dict: StateDict) -> StateDict: ...

    def from_torchtitan(self, state_dict: StateDict) -> StateDict: ...


@runtime_checkable
class HFStateDictAdapter(StateDictAdapter, Protocol):
    """An adapter that also maps to and from Hugging Face names (fusing or splitting
    tensors where the layouts differ): what ``model.hf=`` loading and export need."""

    def to_hf(self, state_dict: StateDict) -> StateDict: ...

    def from_hf(self, hf_state_dict: StateDict) -> StateDict: ...

    # Optional: ``to_hf_modules(state_dict)``, our names -> the module names of the model
    # transformers' ``from_pretrained`` builds, where they differ from the checkpoint's
    # (renames and fusions applied at load). PEFT adapters use these (``peft/mapping.py``).
