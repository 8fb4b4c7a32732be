"""What the launcher's fork server imports once, so that every rank forked from it
starts with these modules in memory instead of importing them again (torch, DCP,
DTensor and the plugins' modules are ~5 s of CPU per rank; on a few cores that was
most of a short multi-rank run).

Only imports: no process group, no threads, no device. A plugin whose import fails
is skipped here on purpose: the rank imports it again and reports the failure.
"""

from __future__ import annotations

import gc

import torch  # noqa: F401
import torch._dynamo  # noqa: F401 - the first meta-device init (torch._refs) imports it: ~1-2 s per rank
import torch._meta_registrations  # noqa: F401 - imported lazily by the first meta-device build
import torch.distributed.checkpoint  # noqa: F401
import torch.distributed.tensor  # noqa: F401

import titan_plugins.components.decoder  # noqa: F401 - the shared blocks (flex attention) models build on
import titan_plugins.train.trainer  # noqa: F401
from titan_plugins._discovery import iter_entry_points


def _import_plugins() -> None:
    for entry_point, _dist in iter_entry_points():
        try:
            entry_point.load()
        except BaseException:  # noqa: BLE001 - see the module docstring
            continue


_import_plugins()
# What was imported here lives as long as the ranks: leave it out of their garbage
# collections (a full one walked all of torch: ~1 s per rank at teardown on a busy CPU).
gc.freeze()
