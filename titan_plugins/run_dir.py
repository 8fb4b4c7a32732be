"""Run directories: claimed atomically, never shared by two live jobs.

- The default ``hydra.run.dir`` / ``hydra.sweep.dir`` (``conf/train.yaml``) go
  through the ``titan_claim`` resolver: the directory is created with an exclusive
  ``mkdir``; when it exists already (two jobs started in the same second) the next
  free ``-1``, ``-2``, ... suffix is claimed instead. The claim is remembered per
  process, so Hydra resolving the key again (every job of a sweep) gets the same one.
- ``hold(run_dir)``: the launcher holds an exclusive ``flock`` on
  ``<run_dir>/.titan.lock`` while its ranks run, so a second job pointed at the same
  directory (an explicit ``hydra.run.dir``) stops with one line instead of
  interleaving its files with the first one's. The lock dies with its process.
- ``check_writable(run_dir)``: a directory that cannot be created or written is a
  ``ConfigError`` naming it, before any rank starts.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

from titan_plugins.errors import ConfigError

__all__ = ["LOCK_FILE", "check_writable", "claim", "forget_claims", "hold", "register_resolver"]

LOCK_FILE = ".titan.lock"
_CLAIMS: dict[str, str] = {}


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
        _CLAIMS[base] = str(candidate)
        return str(candidate)
    raise ConfigError(f"hydra.run.dir={base}: 10000 directories of that name exist already")


def forget_claims() -> None:
    """A new ``titan-run`` in this process claims new directories."""
    _CLAIMS.clear()


def register_resolver() -> None:
    from omegaconf import OmegaConf

    if not OmegaConf.has_resolver("titan_claim"):
        OmegaConf.register_new_resolver("titan_claim", claim)


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
    """Own ``run_dir`` for the block: a second live job on it is a ``ConfigError``."""
    path = Path(run_dir) / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise
            owner = os.pread(fd, 64, 0).decode(errors="replace").strip() or "?"
            raise ConfigError(
                f"run directory {run_dir} is in use by another live job (pid {owner}); choose another hydra.run.dir"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        yield
    finally:
        os.close(fd)
