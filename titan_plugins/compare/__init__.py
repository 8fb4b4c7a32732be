"""titan-compare: prove that a parallelism change does not change the loss."""

from titan_plugins.compare.curves import Curve
from titan_plugins.compare.diff import Verdict, compare_curves, compare_params
from titan_plugins.compare.tolerances import (
    BITWISE,
    GRAD_NORM_PARITY,
    LOSS_PARITY,
    PARAM_PARITY,
    Tolerance,
)

__all__ = [
    "BITWISE",
    "GRAD_NORM_PARITY",
    "LOSS_PARITY",
    "PARAM_PARITY",
    "Curve",
    "Tolerance",
    "Verdict",
    "compare_curves",
    "compare_params",
]
