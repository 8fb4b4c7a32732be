"""The ``peft`` config group (``peft=none`` / ``peft=lora`` / ``peft=qlora``): its typed schema.

Light on purpose (no torch): the schema is imported when Hydra composes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from omegaconf import DictConfig

__all__ = ["ALL_LINEAR", "PeftConfig", "PeftMethod", "lora_enabled"]

# ``peft.target_modules=[all-linear]``: every nn.Linear except the modules that live
# only on the first or last pipeline stage (the output projection), as peft's own.
ALL_LINEAR = "all-linear"


class PeftMethod(str, Enum):
    none = "none"  # full fine-tuning: every parameter trains
    lora = "lora"  # frozen base, low-rank adapters on the matched nn.Linear modules
    qlora = "qlora"  # lora over a 4-bit (NF4) frozen base: titan_plugins/peft/qlora.py


@dataclass
class PeftConfig:
    """LoRA (titan_plugins/peft): ``W x + (alpha / rank) * B A dropout(x)`` on every
    ``nn.Linear`` whose name matches ``target_modules``, ``B`` zero at the start.

    Patterns: a module's full name (``layers.0.attention.wq``), a suffix of it
    (``wq``, ``attention.wq``) or a glob over either (``layers.*.attention.w[qkv]``);
    ``all-linear`` for every ``nn.Linear`` but the output projection. Grouped MoE experts
    only by name (``experts``, ``experts.w1``): one pair per expert (``peft/experts.py``).
    """

    method: PeftMethod = PeftMethod.none
    rank: int = field(default=8, metadata={"range": "[1, inf)"})
    alpha: float = field(default=16.0, metadata={"range": "(0, inf)"})
    dropout: float = field(default=0.0, metadata={"range": "[0, 1)"})
    target_modules: list[str] = field(default_factory=lambda: [ALL_LINEAR])
    init_from: str | None = None  # a PEFT adapter folder to continue training from
    adapter_only_checkpoints: bool = True  # checkpoints hold what trains (base: model.hf / init_from)


def lora_enabled(job: DictConfig) -> bool:
    """Whether the job trains LoRA adapters (peft.method lora, or qlora: LoRA on a 4-bit base)."""
    peft = job.get("peft") if hasattr(job, "get") else getattr(job, "peft", None)
    if peft is None:
        return False
    return str(getattr(peft.method, "value", peft.method)) in ("lora", "qlora")  # qlora: LoRA on a 4-bit base
