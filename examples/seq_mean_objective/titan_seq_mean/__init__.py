"""The objective's spec: light (no torch), so listing objectives stays cheap. The class
is imported only when a run chooses ``objective.name=seq_mean``."""

from __future__ import annotations

from titan_plugins.objectives import DataKind, ObjectiveSpec

__all__ = ["SPEC"]

SPEC = ObjectiveSpec(
    name="seq_mean",
    build="titan_seq_mean.objective:SequenceMeanSFT",
    data=DataKind.rows,
    description="SFT where each sequence weighs the same (the mean of its tokens' loss), "
    "not each token (example package)",
)
