"""What an objective package hands over: an ``ObjectiveSpec`` (light: no torch).

A third party registers one under the entry-point group ``titan_plugins.objectives``::

    [project.entry-points."titan_plugins.objectives"]
    my_loss = "my_pkg.objective:SPEC"

``build`` names the ``Objective`` subclass (``"module:Class"``); it is imported only
when a run chooses ``objective.name=<name>``, so listing objectives stays cheap.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from titan_plugins.spec import Ref

__all__ = ["DataKind", "ObjectiveSpec"]


class DataKind(str, Enum):
    """The batches an objective trains on."""

    rows = "rows"  # token rows with labels (pre-training, chat SFT)
    pairs = "pairs"  # preference pairs: a batch is [chosen rows; rejected rows]
    prompts = "prompts"  # prompts whose completions the objective samples (its rollout stage)


@dataclass(frozen=True)
class ObjectiveSpec:
    name: str
    build: Ref  # "module:Class", an Objective subclass taking the objective config
    data: DataKind = DataKind.rows
    needs_reference: bool = False  # a frozen reference model (or the base under LoRA)
    description: str = ""
