"""``rollout=vllm``'s weight push: the live policy's parameters, gathered to full tensors,
renamed to Hugging Face's names and handed to a colocated engine in bounded buckets.

- **Gather.** Each parameter in turn (``named_parameters``: tied weights once, as vLLM
  wants them), a DTensor (FSDP2's shards, TP's) made whole with ``full_tensor()``. That
  is a collective: every rank walks the same parameters in the same order, and every
  rank keeps the result, since every rank owns an engine (``rollout_vllm.py``).
- **Rename.** Through the plugin's state-dict adapter (``to_hf``, as ``titan-export``
  names a folder; ``model=hf``'s adapter too), one layer at a time (``layers.N.``): a
  tensor Hugging Face fuses from several of ours (gate and up projections) finds its
  partners in its own layer.
- **Bucket.** Consecutive Hugging Face tensors up to ``bucket_mb`` MiB per
  ``load_weights`` call; a tensor larger than that goes alone. So the push holds at most
  one layer's gathered tensors and one bucket, never the whole model.
- **LoRA.** Only the adapters: each update writes them as a PEFT folder
  (``titan-export --adapter``'s format) that the engine loads under a new LoRA id, and the
  previous id is removed. The frozen base is the ``model.hf`` folder's, which the engine
  loaded once when it was built; it is never pushed, because a LoRA-enabled vLLM engine
  cannot take ``load_weights`` (its layers are wrapped: ``qkv_proj.base_layer.weight``,
  vllm-project/vllm#39934). ``rollout_vllm.check_vllm_layout`` refuses a LoRA run whose
  base is not that folder's.
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from titan_plugins.peft.lora import is_adapter_key
from titan_plugins.peft.targets import canonical_name

if TYPE_CHECKING:
    from torch import nn

    from titan_plugins.objectives.job import JobView
    from titan_plugins.objectives.rollout_vllm import ColocatedEngine

__all__ = ["LoraAdapter", "WeightPusher", "buckets", "gathered", "hf_tensors", "pusher_for_run"]

Named = Iterable[tuple[str, torch.Tensor]]
ToHF = Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]
MIB = 1 << 20


@dataclass(frozen=True)
class LoraAdapter:
    """One update's adapters as the engine loads them (vLLM's ``LoRARequest`` fields)."""

    name: str
    lora_id: int  # positive, new per update: vLLM caches an adapter by its id
    path: Path


@torch.no_grad()
def gathered(parts: list[nn.Module], keep: Callable[[str], bool]) -> Iterator[tuple[str, torch.Tensor]]:
    """``(our name, full tensor)`` of each parameter whose name ``keep`` accepts, one at a time."""
    from torch.distributed.tensor import DTensor

    for part in parts:
        for name, param in part.named_parameters():
            name = canonical_name(name)
            if not keep(name):
                continue
            value = param.detach()
            yield name, value.full_tensor() if isinstance(value, DTensor) else value


def _layer(name: str) -> str:
    match = re.match(r"^(.*?\.\d+)\.", name)
    return match.group(1) if match else ""


def hf_tensors(named: Named, to_hf: ToHF) -> Iterator[tuple[str, torch.Tensor]]:
    """``named`` under Hugging Face's names, converted one layer (consecutive run of names
    sharing ``layers.N.``) at a time."""
    group: dict[str, torch.Tensor] = {}
    layer = None
    for name, value in named:
        if group and _layer(name) != layer:
            yield from to_hf(group).items()
            group = {}
        layer = _layer(name)
        group[name] = value
    if group:
        yield from to_hf(group).items()


def buckets(named: Named, limit_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Consecutive runs of ``named`` of at most ``limit_bytes`` each (a larger tensor alone)."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, value in named:
        nbytes = value.numel() * value.element_size()
        if bucket and size + nbytes > limit_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, value))
        size += nbytes
    if bucket:
        yield bucket


class WeightPusher:
    """Pushes the live policy into a :class:`ColocatedEngine` (module docstring).
    ``lora_dir``: where each update's PEFT folder goes (``None``: full fine-tuning, every
    parameter); ``write_adapter(folder, adapters)`` writes one from our adapter tensors."""

    def __init__(self, to_hf: ToHF, bucket_mb: int, lora_dir: Path | None = None,
                 write_adapter: Callable[[Path, dict[str, torch.Tensor]], None] | None = None) -> None:
        self.to_hf, self.limit = to_hf, int(bucket_mb) * MIB
        self.lora_dir, self.write_adapter = lora_dir, write_adapter
        self.lora: LoraAdapter | None = None
        self.updates = 0

    def push(self, parts: list[nn.Module], engine: ColocatedEngine) -> None:
        if self.lora_dir is not None:
            self._push_adapters(parts, engine)
            return
        for bucket in buckets(hf_tensors(gathered(parts, lambda name: True), self.to_hf), self.limit):
            engine.load_weights(bucket)

    def _push_adapters(self, parts: list[nn.Module], engine: ColocatedEngine) -> None:
        assert self.lora_dir is not None and self.write_adapter is not None
        adapters = {name: value.cpu() for name, value in gathered(parts, is_adapter_key)}
        self.updates += 1
        folder = self.lora_dir / f"update-{self.updates}"
        shutil.rmtree(folder, ignore_errors=True)  # a resumed run's earlier folder of that name
        folder.mkdir(parents=True)
        self.write_adapter(folder, adapters)
        old, self.lora = self.lora, LoraAdapter(f"policy-{self.updates}", self.updates, folder)
        if old is not None:
            engine.remove_lora(old.lora_id)
            shutil.rmtree(old.path, ignore_errors=True)


def pusher_for_run(run: JobView, bucket_mb: int, lora: bool) -> WeightPusher:
    """The pusher of a run: its plugin's ``to_hf``, under LoRA a PEFT folder per update in
    ``<run_dir>/vllm-lora/rank<R>``."""
    from titan_plugins.config.hydra_glue import model_config
    from titan_plugins.export.hf_folder import make_adapter

    job, spec = run.job, run.spec
    config = model_config(job.model, spec)
    to_hf = make_adapter(spec, config, job.model.get("hf")).to_hf
    if not lora:
        return WeightPusher(to_hf, bucket_mb)

    def write_adapter(folder: Path, adapters: dict[str, Any]) -> None:
        from titan_plugins.export.lora import write_peft_adapter  # the one PEFT folder writer

        write_peft_adapter(folder, spec, config, job, adapters)

    return WeightPusher(to_hf, bucket_mb, Path(run.run_dir) / "vllm-lora" / f"rank{run.rank}", write_adapter)
