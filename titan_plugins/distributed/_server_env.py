"""Imported first by the ranks' fork server (``launcher._start_fork_server``): the server
was started with ``PYTHONSAFEPATH`` and the launcher's ``sys.path`` as ``PYTHONPATH`` so
that it imports what the launcher imports; this puts the user's own values of both back
into the environment the ranks (and whatever they start) inherit."""

from __future__ import annotations

import json
import os

SERVER_ENV_SAVED = "TITAN_FORKSERVER_SAVED_ENV"  # launcher.SERVER_ENV_SAVED (kept import-free)

_saved = os.environ.pop(SERVER_ENV_SAVED, None)
if _saved is not None:
    for _key, _value in json.loads(_saved).items():
        if _value is None:
            os.environ.pop(_key, None)
        else:
            os.environ[_key] = _value
