"""A rank entry point for tests/test_launch_claims.py: it records what the rank imported
(``titan_plugins``' file, ``sys.path``) next to the config it was handed."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import titan_plugins  # at import: the fork server preloads this module (the entry's)


def entry(config_path: str) -> None:
    out = Path(config_path).parent / f"probe-{os.environ.get('RANK', '0')}.json"
    out.write_text(json.dumps({"titan_plugins": titan_plugins.__file__, "sys_path": sys.path,
                               "pythonpath": os.environ.get("PYTHONPATH"),
                               "safepath": os.environ.get("PYTHONSAFEPATH")}))
