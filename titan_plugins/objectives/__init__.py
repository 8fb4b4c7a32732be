"""Training objectives: the seam between the train step and what it minimises.

``objective=sft`` (default) is next-token cross-entropy; ``objective=dpo`` the DPO
family on preference pairs. A third party adds one with an ``ObjectiveSpec`` under the
entry-point group ``titan_plugins.objectives`` (docs/writing-a-plugin.md). Importing
this package is light (no torch): ``Objective`` itself lives in ``.base``.
"""

from __future__ import annotations

from titan_plugins.objectives.registry import (
    ENTRY_POINT_GROUP,
    ObjectiveRegistry,
    build_objective,
    discover,
)
from titan_plugins.objectives.spec import DataKind, ObjectiveSpec

__all__ = ["ENTRY_POINT_GROUP", "DataKind", "ObjectiveRegistry", "ObjectiveSpec", "build_objective", "discover"]
