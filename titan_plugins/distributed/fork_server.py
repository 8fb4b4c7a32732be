"""The ranks' fork server: started once per process, kept for the launches that follow.

The server imports torch and the trainer once (``preload``) and every rank forks from
it: a spawned rank re-imports them, ~5 s of CPU each. Starting the server costs the
same ~6 s of CPU, so a process that launches several jobs (a Hydra multirun, a test
suite, a notebook) keeps it and forks the next job's ranks from it too. The server
forks before any rank state exists (no threads, no device, no process group) and never
changes after its imports, so a rank of the tenth job starts as clean as one of the first.

What a rank must not inherit from the server is the moment it started: each launch
hands its ranks its own environment and working directory (:class:`RankEntry`), and a
server whose imports could differ from what this launch would import (another
``sys.path``, a distribution installed meanwhile, other preloaded modules, other
environment variables, other signals to ignore) is stopped and started anew.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import socket
import sys
import threading
from collections.abc import Callable, Sequence

from titan_plugins.distributed.rank_signals import reset_inherited

__all__ = ["RankEntry", "ensure_server", "fork_from_self", "import_key", "server_pid", "start_method", "stop_server"]

# The ranks' fork server restores these in its own environment (_server_env.py) once its
# sys.path is set up, so that the ranks and their children see the launcher's environment.
SERVER_ENV_SAVED = "TITAN_FORKSERVER_SAVED_ENV"
# Variables that change from launch to launch without changing what the server imports:
# handed to the ranks (RankEntry), not a reason for a new server. The project's own
# ``TITAN_*`` variables are read when a job runs, never at import (keep it so; the
# preload imports installed plugins only, not ``TITAN_PLUGINS_EXTRA``'s modules).
_PER_LAUNCH = frozenset({"PYTEST_CURRENT_TEST"})
_PER_LAUNCH_PREFIX = "TITAN_"

_running_key: tuple | None = None  # what the running server was started for
_fork_from_self = False  # this process is as clean as a new server would be (train/zygote.py)


def fork_from_self() -> None:
    """This process holds the ranks' imports and nothing of a job yet (a launcher forked
    by the zygote): its fork server is a fork of it, not a new interpreter."""
    global _fork_from_self
    _fork_from_self = True


def start_method(preload: Sequence[str], ignored_signals: Sequence[int] = ()) -> str:
    """``forkserver`` where the platform has it (a running server started for the same
    imports is kept), else ``spawn``."""
    global _running_key
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return "spawn"
    modules = ["titan_plugins.distributed._server_env", "torch", *preload]
    key = import_key(modules, ignored_signals)
    if key == _running_key and server_pid() is not None:
        return "forkserver"
    if not stop_server():
        return "spawn"  # this Python offers no way to stop one started for other imports
    multiprocessing.set_forkserver_preload(modules)
    _running_key = key
    return "forkserver"


def ensure_server() -> None:
    """Start the fork server (if it is not running) with exactly this process's ``sys.path``.

    Python (3.11) starts the server with ``python -c``, which puts the current directory
    first on its ``sys.path`` and ignores the ``sys_path`` it is handed, so a
    ``titan_plugins/`` (or ``torch/``) folder where the user typed the command would be
    what the ranks import. The server starts with ``PYTHONSAFEPATH`` (no current
    directory) and this process's ``sys.path`` as its ``PYTHONPATH``; its first preloaded
    module puts the user's own values of both back before any rank forks."""
    from multiprocessing import forkserver

    if server_pid() is not None:
        return
    if _fork_from_self and threading.active_count() == 1:
        _fork_server_here()
        return
    saved = {key: os.environ.get(key) for key in ("PYTHONPATH", "PYTHONSAFEPATH")}
    os.environ[SERVER_ENV_SAVED] = json.dumps(saved)
    os.environ["PYTHONSAFEPATH"] = "1"
    # "" (``python -m`` / ``-c`` in this process) is this process's current directory
    os.environ["PYTHONPATH"] = os.pathsep.join(p or os.getcwd() for p in sys.path)
    try:
        forkserver.ensure_running()
    finally:
        os.environ.pop(SERVER_ENV_SAVED, None)
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _fork_server_here() -> None:
    """What ``forkserver.ensure_running`` does, with ``os.fork`` for its ``python -c``: the
    server starts with everything this process imported, and none of its open files, and
    imports what of the launch's preload this process has not (a model's ``rank_imports``)."""
    from multiprocessing import connection, forkserver, resource_tracker

    from titan_plugins.distributed import _server_env

    resource_tracker.ensure_running()
    address = connection.arbitrary_address("AF_UNIX")
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(address)
    os.chmod(address, 0o600)
    listener.listen()
    alive_r, alive_w = os.pipe()
    server = forkserver._forkserver
    preload = [m for m in getattr(server, "_preload_modules", ()) if m != "__main__"]
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            os.close(alive_w)
            _close_fds_except({0, 1, 2, listener.fileno(), alive_r})
            _server_env.STARTED_WITH = dict(os.environ)
            forkserver.main(listener.fileno(), alive_r, preload)
        except SystemExit:
            pass
        except BaseException:  # noqa: BLE001 - the server dies; the launch reports it
            code = 1
        os._exit(code)
    listener.close()
    os.close(alive_r)
    server._forkserver_address, server._forkserver_alive_fd, server._forkserver_pid = address, alive_w, pid


def _close_fds_except(keep: set[int]) -> None:
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd not in keep:
            try:
                os.close(fd)
            except OSError:
                pass


def server_pid() -> int | None:
    """The pid of this process's fork server, if one is running."""
    from multiprocessing import forkserver

    pid = getattr(getattr(forkserver, "_forkserver", None), "_forkserver_pid", None)
    if pid is None:
        return None
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return None
    return None if done else pid


def stop_server() -> bool:
    """Stop this process's fork server if one runs (it restarts on next use); False
    where this Python offers no way to (``_stop`` is CPython's own, used by its tests)."""
    global _running_key
    from multiprocessing import forkserver

    stop = getattr(getattr(forkserver, "_forkserver", None), "_stop", None)
    if stop is None:
        return False
    stop()
    _running_key = None
    return True


def import_key(modules: Sequence[str], ignored_signals: Sequence[int] = ()) -> tuple:
    """What the server's imports depend on: the modules, ``sys.path``, the environment,
    and the distributions installed (the mtime of every site-packages folder on
    ``sys.path`` changes when one is installed or removed; an editable install's source
    folder is not one: its files change, not its listing, and ``train/zygote.py`` watches those)."""
    paths = tuple(p or os.getcwd() for p in sys.path)
    env = tuple(sorted((k, v) for k, v in os.environ.items()
                       if k not in _PER_LAUNCH and not k.startswith(_PER_LAUNCH_PREFIX)))
    return tuple(modules), tuple(sorted(int(s) for s in ignored_signals)), paths, _install_mtimes(paths), env


def _install_mtimes(paths: Sequence[str]) -> tuple:
    out = []
    for path in paths:
        if os.path.basename(path.rstrip(os.sep)) not in ("site-packages", "dist-packages"):
            continue  # a source tree (its listing changes as tests and tools write into it)
        try:
            out.append((path, os.stat(path).st_mtime_ns))
        except OSError:
            continue
    return tuple(out)


class RankEntry:
    """What each rank process runs: ``entry`` after resetting what the rank inherited.

    - The launch's environment and working directory, not the server's (it may have
      started for an earlier launch); what the elastic agent set for this rank (RANK,
      WORLD_SIZE, ...) on top.
    - Signal handlers: a job in the background of a script ignores SIGINT in every
      process it starts (see ``rank_signals``).
    - The default start method: a rank forked from the fork server inherits
      ``forkserver``, so each DataLoader would start a fork server of its own whose
      workers watch that server, not the rank, and outlive the rank. Ranks start their
      children with ``fork``, as a rank started by torchrun does.
    (Its pid reaches the launcher's ``forward`` once it handles the signal:
    ``rank_signals.install_preemption``.)"""

    def __init__(self, entry: Callable[[str], object]) -> None:
        self.entry = entry
        self.environ = dict(os.environ)
        self.cwd = os.getcwd()
        # elastic names the job after it
        self.__name__ = getattr(entry, "__name__", "entry")
        self.__qualname__ = getattr(entry, "__qualname__", self.__name__)

    def __call__(self, *args: object) -> object:
        self._take_launch_environment()
        reset_inherited()
        if "fork" in multiprocessing.get_all_start_methods():
            multiprocessing.set_start_method("fork", force=True)
        return self.entry(*args)

    def _take_launch_environment(self) -> None:
        from titan_plugins.distributed import _server_env

        started = _server_env.STARTED_WITH
        if started is None:  # spawned, not forked from the server: the launch's own already
            return
        agent_set = {k: v for k, v in os.environ.items() if started.get(k) != v}
        os.environ.clear()
        os.environ.update(self.environ)
        os.environ.update(agent_set)
        os.chdir(self.cwd)
