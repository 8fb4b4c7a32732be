"""A test plugin that parks every rank after a chosen step (``TITAN_TEST_PARK_AFTER=N``),
so that a test can send a real signal to a real rank process mid-run."""

from __future__ import annotations

import os
import time
from typing import Any

from titan_plugins.hookspecs import hookimpl

TITAN_PLUGINS_API = ">=1.0,<2"


@hookimpl
def titan_on_step_end(step: int, metrics: dict[str, float], job_config: Any, rank: int) -> None:
    park = int(os.environ.get("TITAN_TEST_PARK_AFTER", "0"))
    if park and step == park:
        path = os.path.join(str(job_config.run_dir), f"parked-{rank}")
        with open(f"{path}.tmp", "w") as f:
            f.write(str(os.getpid()))
        os.replace(f"{path}.tmp", path)  # the pid, for the test's signal
        time.sleep(120)  # the test kills a rank; the launcher stops this one
