"""A warm process that starts job launchers (a "zygote"): ``train.api.run`` forks each
job's launcher from it instead of starting ``python -m titan_plugins.train.worker``.

A launcher started from scratch imports torch (~1.5 s of CPU) and then starts the
ranks' fork server, a second interpreter that imports torch, torch._dynamo, the
trainer and the plugins (~6 s). A process that runs many short jobs (a test suite, a
sweep written in Python, a notebook) paid that for every job. The zygote imports all
of it once, with the installed models' ``rank_imports`` (transformers for model=hf),
then forks a launcher per job; the launcher forks the ranks' fork server from itself
(``fork_server.fork_from_self``), so a job's ranks start from the same imports
without a new interpreter.

Each launcher starts as a fresh ``python -m titan_plugins.train.worker`` would: its own
session (killed as a group on timeout), the caller's environment, working directory
and ``PYTHONPATH`` entries, its output in the caller's files, its exit code (a signal
as ``-N``) reported back. The zygote forks before anything of a job exists (no
threads, no process group), so every launcher is as clean as the first.

A zygote started for other imports (another ``sys.path``, a distribution installed
meanwhile, other environment variables) is replaced (``fork_server.import_key``); it
exits when the process that started it does. ``TITAN_WARM_START=0`` turns it off.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import importlib
import os
import pickle
import selectors
import signal
import socket
import subprocess
import sys
import threading
import traceback
from multiprocessing.connection import Connection, wait
from typing import Any

__all__ = ["WarmChild", "enabled", "popen_module", "serve", "start", "start_worker"]

WORKER = "titan_plugins.train.worker"
PRELOAD = ("titan_plugins.train.preload", WORKER)
WARM_START_ENV = "TITAN_WARM_START"
STALE = "stale"  # the zygote's answer when a source file it imported changed since

_lock = threading.Lock()
_zygote: tuple[subprocess.Popen, socket.socket, tuple] | None = None
_report: dict | None = None  # what the running zygote's imports did (_imports_report), once it sent it


def enabled() -> bool:
    return (os.environ.get(WARM_START_ENV, "1") != "0" and hasattr(os, "fork")
            and hasattr(socket, "send_fds") and sys.platform.startswith("linux"))


class WarmChild:
    """A launcher forked by the zygote, with what callers use of ``Popen``: ``pid`` (its
    session's id), ``poll``, ``wait``, ``returncode`` and, started by :func:`start_worker`,
    ``communicate`` (its output as text)."""

    def __init__(self, pid: int, conn: Connection, output: tuple | None = None) -> None:
        self.pid, self._conn, self.returncode = pid, conn, None
        self._output, self._text = output, None

    def poll(self) -> int | None:
        try:
            return self.wait(0)
        except subprocess.TimeoutExpired:
            return None

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            if not wait([self._conn], timeout):
                raise subprocess.TimeoutExpired(f"launcher {self.pid}", timeout)
            try:
                self.returncode = self._conn.recv()
            except EOFError:  # the zygote died: nothing can report this launcher's status
                self.returncode = 1
            self._conn.close()
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        self.wait(timeout)
        if self._text is None:
            texts = []
            for f in self._output:
                f.seek(0)
                texts.append(f.read())
                f.close()
            self._text = (texts[0], texts[1])
        return self._text


def start_worker(argv: list[str], env: dict[str, str]) -> WarmChild | None:
    """:func:`start` with the launcher's output kept in temporary files for
    ``communicate``; None where no zygote serves."""
    import tempfile

    output = (tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+"))
    child = start(argv, env=env, stdout=output[0].fileno(), stderr=output[1].fileno())
    if child is None:
        for f in output:
            f.close()
        return None
    child._output = output
    return child


def popen_module(module: str, argv: list[str], *, env: dict[str, str], stdout: int, stderr: int) -> Any:
    """``python -m module *argv`` in a session of its own, its output on the ``stdout`` /
    ``stderr`` fds: forked from the zygote (a :class:`WarmChild`), else a ``Popen``. For
    processes that train with what the zygote imported (the test kit's ranks)."""
    child = start(argv, env=env, stdout=stdout, stderr=stderr, module=module)
    if child is not None:
        return child
    return subprocess.Popen([sys.executable, "-m", module, *argv], env=env, stdout=stdout, stderr=stderr,
                            stdin=subprocess.DEVNULL, start_new_session=True)


def start(argv: list[str], *, env: dict[str, str], stdout: int, stderr: int, module: str = WORKER) -> WarmChild | None:
    """Fork ``python -m module *argv`` (by default the job launcher,
    ``titan_plugins.train.worker.main(argv)``) from the zygote with ``env`` and this
    process's working directory, its output on the ``stdout`` / ``stderr`` fds; None where
    no zygote can serve (the caller starts the process itself)."""
    if not enabled():
        return None
    for _ in range(2):  # a zygote whose sources changed on disk exits: a new one serves
        child = _request(module, argv, env, stdout, stderr)
        if child != STALE:
            return child
    return None


def _request(module: str, argv: list[str], env: dict[str, str], stdout: int, stderr: int) -> WarmChild | str | None:
    from titan_plugins.distributed.fork_server import import_key

    with _lock:
        global _zygote, _report
        key = import_key(PRELOAD)
        if _zygote is not None and (_zygote[0].poll() is not None or not _serves(_zygote[2], key)):
            _stop(_zygote)
            _zygote = None
        if _zygote is None:
            _zygote, _report = _start_zygote(key), None
        zygote = _zygote
        mine, theirs = socket.socketpair()
        try:
            socket.send_fds(zygote[1], [b"j"], [theirs.fileno(), stdout, stderr])
        except OSError:  # the zygote is gone
            mine.close()
            return None
        finally:
            theirs.close()
    conn = Connection(mine.detach())
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    conn.send((module, list(argv), dict(env), os.getcwd(), paths))
    with _lock:
        if _report is None and _zygote is zygote:  # sent before it serves the first request
            _report = _read_report(zygote[1])
    try:
        pid = conn.recv()
    except EOFError:
        conn.close()
        return None
    if pid == STALE:  # it exits once the launchers it started have ended
        conn.close()
        with _lock:
            if _zygote is zygote:
                _zygote = None
                zygote[1].close()
                threading.Thread(target=zygote[0].wait, daemon=True).start()  # reaped, never a zombie
        return STALE
    return WarmChild(pid, conn)


def _serves(started: tuple, key: tuple) -> bool:
    """Whether a zygote started for the import key ``started`` imported what one started
    now would (``fork_server.import_key``: modules, signals, sys.path, installs, env).
    Beyond equality: an environment variable its own imports set (transformers sets some
    in every process that imports it) is not a difference, nor is a sys.path folder
    added or removed that holds none of the top-level modules it imported (a test's
    ``monkeypatch.syspath_prepend``). Without its report, equality only."""
    if started == key:
        return True
    if _report is None or started[:2] != key[:2] or started[3] != key[3]:
        return False
    set_by_imports = _report["env"]
    if {k: v for k, v in started[4] if k not in set_by_imports} != \
            {k: v for k, v in key[4] if k not in set_by_imports}:
        return False
    before, now = started[2], key[2]
    common = [p for p in now if p in before]
    if common != [p for p in before if p in now]:  # reordered: another folder may win a name
        return False
    tops, origins = _report["modules"], _report["origins"]
    if any(p in origins for p in before if p not in now):
        return False
    return not any(_holds(p, tops) for p in now if p not in before)


def _holds(folder: str, names: frozenset[str]) -> bool:
    """Whether ``folder`` (a sys.path entry) holds a top-level module named in ``names``."""
    try:
        entries = os.listdir(folder)
    except FileNotFoundError:
        return False
    except OSError:
        return True  # unreadable (a zip, say): assume it might
    return any(e.split(".", 1)[0] in names for e in entries)


def _read_report(control: socket.socket) -> dict | None:
    conn = Connection(os.dup(control.fileno()))  # its framing; the socket stays the zygote's control
    try:
        return conn.recv()
    except (OSError, EOFError, pickle.UnpicklingError):
        return None
    finally:
        conn.close()


def _imports_report(start_env: dict[str, str]) -> dict:
    """What the zygote's imports did: environment variables they set or changed, the
    top-level modules imported and the sys.path folders those came from."""
    env = frozenset(k for k in set(start_env) | set(os.environ) if start_env.get(k) != os.environ.get(k))
    tops, origins = set(), set()
    entries = sorted((p for p in sys.path if p), key=len, reverse=True)
    for name, module in list(sys.modules.items()):
        if "." in name:
            continue
        tops.add(name)
        path = getattr(module, "__file__", None) or ""
        found = next((p for p in entries if path.startswith(p.rstrip(os.sep) + os.sep)), None)
        if found:
            origins.add(found)
    return {"env": env, "modules": frozenset(tops), "origins": frozenset(origins)}


def _start_zygote(key: tuple) -> tuple[subprocess.Popen, socket.socket, tuple]:
    mine, theirs = socket.socketpair()
    env = dict(os.environ)
    # This process's imports, not those of a folder named like a package in the cwd.
    env["PYTHONSAFEPATH"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(p or os.getcwd() for p in sys.path)
    proc = subprocess.Popen(
        [sys.executable, "-c", f"from titan_plugins.train.zygote import serve; serve({theirs.fileno()})"],
        pass_fds=[theirs.fileno()], env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL, start_new_session=True)
    theirs.close()
    atexit.register(_stop, (proc, mine, key))
    return proc, mine, key


def _stop(zygote: tuple[subprocess.Popen, socket.socket, tuple]) -> None:
    proc, control, _ = zygote
    control.close()  # the zygote exits on EOF
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


# --- the zygote's side -------------------------------------------------------------


def serve(control_fd: int) -> None:
    """The zygote's loop: import, then fork a launcher per request until the control
    socket closes."""
    start_env = dict(os.environ)
    for module in PRELOAD:
        importlib.import_module(module)
    _import_rank_modules()
    sources = _source_mtimes()
    report = _imports_report(start_env)
    gc.freeze()
    control = socket.socket(fileno=control_fd)
    with contextlib.suppress(OSError):
        reporter = Connection(os.dup(control_fd))
        reporter.send(report)
        reporter.close()
    sig_r, sig_w = os.pipe()
    os.set_blocking(sig_r, False)
    os.set_blocking(sig_w, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.set_wakeup_fd(sig_w)
    replies: dict[int, Connection] = {}
    draining = False
    with selectors.DefaultSelector() as selector:
        selector.register(control, selectors.EVENT_READ)
        selector.register(sig_r, selectors.EVENT_READ)
        while True:
            ready = [key.fileobj for key, _ in selector.select()]
            if sig_r in ready:
                with contextlib.suppress(BlockingIOError):
                    os.read(sig_r, 4096)
                _reap(replies)
                if draining and not replies:
                    return
            if control in ready:
                try:
                    _, fds, _, _ = socket.recv_fds(control, 1, 3)
                except OSError:
                    fds = []
                if len(fds) != 3:  # EOF: the caller is gone
                    return
                reply = Connection(fds[0])
                try:
                    request = reply.recv()
                except (EOFError, OSError, pickle.UnpicklingError):
                    request = None
                stale = request is not None and _changed(sources)
                if request is None or stale:
                    with contextlib.suppress(OSError):
                        if stale:  # edited since imported: a launcher would run the old code
                            reply.send(STALE)
                    reply.close()
                    for fd in fds[1:]:
                        os.close(fd)
                    if stale:  # no new launcher; the running ones still report their exit
                        selector.unregister(control)
                        draining = True
                        if not replies:
                            return
                    continue
                pid = os.fork()
                if pid == 0:
                    others = [c.fileno() for c in replies.values()]
                    _launcher(request, fds[1], fds[2],
                              keep_closed=[control_fd, sig_r, sig_w, fds[0], selector.fileno(), *others])
                for fd in fds[1:]:
                    os.close(fd)
                with contextlib.suppress(OSError):
                    reply.send(pid)
                replies[pid] = reply
                _reap(replies)


def _import_rank_modules() -> None:
    """The ``rank_imports`` of every installed model (``transformers`` for model=hf):
    every launcher forked from here, and its ranks, start with them. A model that does
    not load, or a module that does not import, is left to the rank to report."""
    from titan_plugins.plugins import ENV_EXTRA, get_plugin_manager

    os.environ.pop(ENV_EXTRA, None)  # installed models only: each launch loads its extra modules itself
    try:
        specs = list(get_plugin_manager().models().values())
    except Exception:  # noqa: BLE001 - see the docstring
        return
    for module in dict.fromkeys(m for spec in specs for m in spec.rank_imports):
        with contextlib.suppress(Exception):
            importlib.import_module(module)


def _source_mtimes() -> dict[str, int]:
    """The source files of the modules imported here that live outside the installation
    folders (an editable install, a plugin on PYTHONPATH): those a developer edits. What
    pip installs changes a folder the caller's key watches (``fork_server.import_key``)."""
    import sysconfig

    installed = tuple({sysconfig.get_path(k) for k in ("stdlib", "platstdlib", "purelib", "platlib")} - {None})
    out = {}
    for module in list(sys.modules.values()):
        path = getattr(module, "__file__", None)
        if path and path.endswith(".py") and not path.startswith(installed):
            with contextlib.suppress(OSError):
                out[path] = os.stat(path).st_mtime_ns
    return out


def _changed(sources: dict[str, int]) -> bool:
    for path, mtime in sources.items():
        try:
            if os.stat(path).st_mtime_ns != mtime:
                return True
        except OSError:
            return True
    return False


def _reap(replies: dict[int, Connection]) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        reply = replies.pop(pid, None)
        if reply is not None:
            with contextlib.suppress(OSError):
                reply.send(os.waitstatus_to_exitcode(status))
            reply.close()


def _launcher(request: tuple, stdout: int, stderr: int, keep_closed: list[int]) -> None:
    """The forked child: become what ``python -m titan_plugins.train.worker`` (or the
    requested module) would be."""
    code = 1
    try:
        module, argv, env, cwd, paths = request
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.setsid()
        for fd in keep_closed:
            with contextlib.suppress(OSError):
                os.close(fd)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.dup2(stdout, 1)
        os.dup2(stderr, 2)
        for fd in (devnull, stdout, stderr):
            os.close(fd)
        os.environ.clear()
        os.environ.update(env)
        os.chdir(cwd)
        # ``python -m`` puts the working directory first, then PYTHONPATH's entries
        sys.path[:0] = [p for p in [cwd, *paths] if p not in sys.path]
        from titan_plugins.distributed import fork_server
        from titan_plugins.train import worker

        fork_server.fork_from_self()
        if module == WORKER:  # its main, not a __main__ copy: the ranks unpickle worker.entry by name
            sys.argv = [worker.__file__, *argv]
            code = worker.main(list(argv))
        else:
            import runpy

            sys.argv = [module, *argv]  # runpy puts the module's file first
            runpy.run_module(module, run_name="__main__", alter_sys=True)
            code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # noqa: BLE001 - the launcher's own crash, as python would print it
        traceback.print_exc()
        code = 1
    finally:
        with contextlib.suppress(BaseException):
            atexit._run_exitfuncs()
        with contextlib.suppress(BaseException):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code if isinstance(code, int) else 1)
