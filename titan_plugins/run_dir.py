"""Run directories: claimed atomically, never shared by two live jobs.

- The default ``hydra.run.dir`` / ``hydra.sweep.dir`` (``conf/train.yaml``) go
  through the ``titan_claim`` resolver: the directory is created with an exclusive
  ``mkdir``; when it exists already (two jobs started in the same second) the next
  free ``-1``, ``-2``, ... suffix is claimed instead. The claim is remembered per
  process, so Hydra resolving the key again (every job of a sweep) gets the same one.
- ``take(run_dir)``: an exclusive ``flock`` on ``<run_dir>/.titan.lock``, taken by the
  launching process *before anything is written into the directory* (Hydra's
  ``.hydra/``, ``config.yaml``, the job log, ``result.json``) and held until the job
  ends, so a second job pointed at the same directory (an explicit ``hydra.run.dir``,
  ``TITAN_RUN_DIR``) stops with one line and leaves the live run's files alone. The
  claim is per process and re-entrant (the launcher taking it again is a no-op); a
  child process the holder starts for the same job learns it through
  ``TITAN_RUN_DIR_OWNER`` (:func:`child_env`). ``claim`` takes it at once for the
  directories it creates. The lock dies with its process.
- ``hold(run_dir)``: a context manager taking a fresh lock (strict: held twice is an error).
- ``check_writable(run_dir)``: a directory that cannot be created or written is a
  ``ConfigError`` naming it, before any rank starts.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import socket
from collections.abc import Iterator
from pathlib import Path

from titan_plugins.errors import ConfigError

__all__ = ["LOCK_FILE", "OWNER_ENV", "check_writable", "child_env", "claim", "forget_claims", "hold", "job_dirname",
           "owned", "register_resolver", "release", "take"]

LOCK_FILE = ".titan.lock"
OWNER_ENV = "TITAN_RUN_DIR_OWNER"  # "<run dir>": the parent process holds this directory's lock
_CLAIMS: dict[str, str] = {}
_HELD: dict[str, int] = {}  # resolved run dir -> the fd holding its lock
_NAME_BYTES = 240  # a sweep job's directory name: NAME_MAX (255) less the "<job number>_" before it


def claim(base: str) -> str:
    """Create ``base`` (or ``base-1``, ``base-2``, ...) exclusively; returns its path."""
    if base in _CLAIMS:
        return _CLAIMS[base]
    path = Path(base)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"hydra.run.dir={base}: cannot create {path.parent} ({exc.strerror})") from None
    for n in range(10_000):
        candidate = path if n == 0 else path.with_name(f"{path.name}-{n}")
        try:
            candidate.mkdir()
        except FileExistsError:
            continue
        except OSError as exc:
            raise ConfigError(f"hydra.run.dir={base}: cannot create it ({exc.strerror})") from None
        take(candidate)  # before Hydra writes .hydra/ into it
        _CLAIMS[base] = str(candidate)
        return str(candidate)
    raise ConfigError(f"hydra.run.dir={base}: 10000 directories of that name exist already")


def job_dirname(overrides: str) -> str:
    """``${titan_job_dirname:${hydra.job.override_dirname}}`` (a sweep job's directory,
    ``conf/train.yaml``): one path component. A path in an override (``model.hf=DIR``,
    ``data.path=FILE``) would nest the job's directory under the sweep's, where the summary
    does not look, so ``/`` becomes ``_``; the name is cut to fit the file system's
    255-byte limit (the job number before it keeps it unique)."""
    name = str(overrides).replace(os.sep, "_")
    return name.encode()[:_NAME_BYTES].decode(errors="ignore")


def forget_claims() -> None:
    """A new ``titan-run`` in this process claims new directories (and releases the old)."""
    _CLAIMS.clear()
    for key in list(_HELD):
        release(key)


def register_resolver() -> None:
    """``${titan_claim:BASE}``. Cached in the config (``use_cache``), and OmegaConf copies
    that cache into every job's config (``load_sweep_config``), so a job that resolves the
    sweep directory in another process (hydra-submitit-launcher's Slurm jobs) gets the
    directory the launching process claimed instead of claiming a new one. Also
    ``${titan_job_dirname:...}`` (:func:`job_dirname`)."""
    from omegaconf import OmegaConf

    if not OmegaConf.has_resolver("titan_claim"):
        OmegaConf.register_new_resolver("titan_claim", claim, use_cache=True)
    if not OmegaConf.has_resolver("titan_job_dirname"):
        OmegaConf.register_new_resolver("titan_job_dirname", job_dirname)


def _lock(path: Path, what: str, key: str) -> int:
    """An fd holding ``path/.titan.lock`` exclusively, or a ``ConfigError`` naming the owner."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        fd = os.open(path / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise ConfigError(f"{key}={what}: the run directory is not writable ({reason})") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        pid, _, host = os.pread(fd, 256, 0).decode(errors="replace").strip().partition(" ")
        os.close(fd)
        if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
            raise
        where = f" on {host}" if host and host != socket.gethostname() else ""
        raise ConfigError(
            f"{key}={what}: run directory {what} is in use by another live job (pid {pid or '?'}){where}; "
            f"choose another {key}"
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()} {socket.gethostname()}".encode(), 0)
    return fd


def _key(run_dir: str | os.PathLike) -> str:
    return str(Path(run_dir).resolve())


def take(run_dir: str | os.PathLike, key: str = "hydra.run.dir") -> bool:
    """Claim ``run_dir`` for this process (created if missing) before anything is written
    into it; a ``ConfigError`` when another live job holds it. Returns False when this
    process (or the parent that started it, :data:`OWNER_ENV`) holds it already."""
    name = _key(run_dir)
    if name in _HELD or os.environ.get(OWNER_ENV) == name:
        return False
    _HELD[name] = _lock(Path(name), str(run_dir), key)
    return True


def release(run_dir: str | os.PathLike) -> None:
    fd = _HELD.pop(_key(run_dir), None)
    if fd is not None:
        os.close(fd)


def child_env(run_dir: str | os.PathLike) -> dict[str, str]:
    """What a child process of the holder needs to use ``run_dir`` without claiming it."""
    return {OWNER_ENV: _key(run_dir)}


@contextlib.contextmanager
def owned(run_dir: str | os.PathLike, key: str = "hydra.run.dir") -> Iterator[None]:
    """``take`` for the block (a no-op where this process holds the directory already)."""
    took = take(run_dir, key)
    try:
        yield
    finally:
        if took:
            release(run_dir)


def check_writable(run_dir: str | os.PathLike, key: str = "hydra.run.dir") -> None:
    """The run directory exists (or can be made) and a file can be written in it."""
    path = Path(run_dir)
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".titan-write-probe.{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise ConfigError(f"{key}={run_dir}: the run directory is not writable ({reason})") from None


@contextlib.contextmanager
def hold(run_dir: str | os.PathLike) -> Iterator[None]:
    """Own ``run_dir`` for the block with a fresh lock: a second live job on it (or a
    second ``hold`` in this process) is a ``ConfigError``."""
    fd = _lock(Path(run_dir), str(run_dir), "hydra.run.dir")
    try:
        yield
    finally:
        os.close(fd)
