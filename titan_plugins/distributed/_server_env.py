"""Imported first by the ranks' fork server (``fork_server.ensure_server``): the server
was started with ``PYTHONSAFEPATH`` and the launcher's ``sys.path`` as ``PYTHONPATH`` so
that it imports what the launcher imports; this puts the user's own values of both back
into the environment the ranks (and whatever they start) inherit, and records that
environment (``STARTED_WITH``) so that a rank can tell what the elastic agent set for it
from what the server started with (``fork_server.RankEntry``)."""

from __future__ import annotations

import json
import os

SERVER_ENV_SAVED = "TITAN_FORKSERVER_SAVED_ENV"  # fork_server.SERVER_ENV_SAVED (kept import-free)

STARTED_WITH: dict[str, str] | None = None  # None: not a fork server (a spawned process)

_saved = os.environ.pop(SERVER_ENV_SAVED, None)
if _saved is not None:
    for _key, _value in json.loads(_saved).items():
        if _value is None:
            os.environ.pop(_key, None)
        else:
            os.environ[_key] = _value
    STARTED_WITH = dict(os.environ)
