"""May an export write (or replace) this output folder? The one policy every writer of
a Hugging Face folder follows (``titan-export``, ``checkpoint.export_hf``, the merged
and PEFT-adapter writers), so that no export ever deletes what a user keeps.

    claim_out_dir(out, "full", overwrite=args.overwrite, protect={"the run directory": run_dir})
    write_export(out, "full", fill)   # fill(tmp) writes into a fresh folder next to ``out``,
                                      # which is then marked and swapped in

``write_export`` is lock -> stale staging removed -> ``staging_dir`` -> ``fill`` ->
plain file modes -> ``publish_dir``, removing the staging folder whatever happens;
every kind of export goes through it.

The rules (``claim_out_dir``, before any work; a ``ConfigError`` in one line):

- a folder that does not exist, or is empty, may be written;
- a non-empty folder may be replaced only when it is a previous export of the same
  ``kind`` (it holds ``.titan-export.json`` saying so) and ``overwrite`` is true;
  anything else (a user's folder, another kind of export) is refused;
- the current directory, the home directory, each ``protect`` path, and every parent
  of those are never replaced, whatever the folder holds (``--out .`` included).

``kind`` is one of ``KINDS``: ``full`` (the trained model), ``merged`` (base with
adapters merged in) or ``peft-adapter`` (a PEFT adapter folder). ``publish_dir``
re-checks the rules it can check without the caller (never a non-export folder,
never a protected one), so a writer that skipped ``claim_out_dir`` still cannot
delete a user's folder; it removes only the staging folder it was given and a
previous export of the same kind.

Under faults (``write_export``):

- **Complete or as it was.** Every file is fsynced, then the marker is written and
  fsynced last, then the folder is swapped in (``renameat2(RENAME_EXCHANGE)`` where the
  file system has it, else two renames, undone on an error): a kill or a power loss at
  any moment leaves ``out`` as it was or the new export, complete; never a marked
  folder with missing or short files.
- **One writer.** An exclusive ``flock`` on ``.NAME.titan-export.lock`` beside ``out``,
  held for the whole write (the kernel drops it when the process dies): a second export
  into ``out`` while one writes is refused in one line, and so is one whose claim saw
  ``out`` before another export replaced it.
- **Stale staging.** A killed export leaves ``.NAME.titan-export.PID.XXXXXXXX.tmp``
  beside ``out``; the next export of ``out`` removes it (it holds the lock, so no
  writer of it is alive; one named after a pid alive here is left alone).
- **Full or read-only disk.** An ``OSError`` (ENOSPC, EROFS, EACCES, ...) while writing
  is an ``OutDirError``: one line naming the folder and the OS error; ``out`` is as it was.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import json
import os
import re
import shutil
import sys
import tempfile
import uuid
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

from titan_plugins.errors import ConfigError, os_errors_behind

__all__ = ["KINDS", "MARKER", "OutDirError", "claim_out_dir", "export_kind", "publish_dir", "staging_dir",
           "write_export"]

MARKER = ".titan-export.json"
KINDS = ("full", "merged", "peft-adapter")
LOCK = ".titan-export.lock"  # ".NAME" + LOCK, beside the folder NAME
# staging_dir's names (mkdtemp's 8 random characters) and the ".old" twin publish_dir may make
_STAGING = re.compile(r"\.(?P<name>.+)\.titan-export\.(?P<pid>\d+)\.[a-z0-9_]{8}\.(tmp|old)")
# resolved folder -> (how its error lines name it, what it held when claimed: _held)
_CLAIMED: dict[Path, tuple[str, str | None]] = {}


class OutDirError(ConfigError):
    """The folder could not be written (a full or read-only disk, no permission): one
    line naming it and the OS error; the folder is as it was."""


def export_kind(folder: str | os.PathLike) -> str | None:
    """The kind of export ``folder`` holds (its marker file), else None."""
    try:
        kind = json.loads((Path(folder) / MARKER).read_text()).get("kind")
    except (OSError, ValueError, AttributeError):
        return None
    return kind if kind in KINDS else None


def _never_replaced(protect: Mapping[str, str | os.PathLike]) -> dict[Path, str]:
    """Every protected folder and each of its parents, with what to call it."""
    named = {"the current directory": Path.cwd(), "the home directory": Path.home(), **protect}
    out: dict[Path, str] = {}
    for what, path in named.items():
        path = Path(path).expanduser().resolve()
        out.setdefault(path, what)
        for parent in path.parents:
            out.setdefault(parent, f"a parent of {what} ({path})")
    return out


def claim_out_dir(
    out: str | os.PathLike,
    kind: str,
    *,
    overwrite: bool = False,
    protect: Mapping[str, str | os.PathLike] | None = None,
    key: str = "--out",
) -> Path:
    """Check that an export of ``kind`` may be written to ``out`` (module docstring);
    returns ``out`` resolved. ``protect``: ``{what it is: path}`` never to replace
    (the run directory, the checkpoint), besides the current and home directories.
    ``key``: how the error line names the folder's option."""
    if kind not in KINDS:
        raise ValueError(f"export kind {kind!r} is not one of {KINDS}")
    given = f"{key} {out}" if key.startswith("-") else f"{key}={out}"
    path = Path(out).expanduser().resolve()
    what = _never_replaced(protect or {}).get(path)
    if what is not None:
        raise ConfigError(f"{given}: is {what}, which an export never replaces; choose a new folder")
    if not path.exists():
        return _claimed(path, given)
    if not path.is_dir():
        raise ConfigError(f"{given}: exists and is not a folder; choose a new folder")
    if not any(path.iterdir()):
        return _claimed(path, given)
    found = export_kind(path)
    if found is None:
        raise ConfigError(
            f"{given}: is not empty and holds no earlier export (no {MARKER}); "
            "choose a new or empty folder"
        )
    if found != kind:
        raise ConfigError(f"{given}: holds a {found} export, not a {kind} one; choose another folder")
    if not overwrite:
        raise ConfigError(f"{given}: holds an earlier {kind} export; pass --overwrite to replace it")
    return _claimed(path, given)


def _held(path: Path) -> str | None:
    """What ``path`` holds, to see whether another export replaced it since it was
    claimed: None (absent or empty), else its marker (each export's has its own id)."""
    if not path.is_dir():
        return "a file" if path.exists() else None
    if not any(path.iterdir()):
        return None
    try:
        return (path / MARKER).read_text()
    except OSError:
        return "no marker"


def _claimed(path: Path, given: str) -> Path:
    _CLAIMED[path] = (given, _held(path))
    return path


def staging_dir(out: str | os.PathLike) -> Path:
    """A new empty folder next to ``out`` (same file system) to write the export into;
    never a folder that existed before. Named after this process
    (``.NAME.titan-export.PID.XXXXXXXX.tmp``), so that a later export can tell it as
    ours when a kill leaves it behind."""
    out = Path(out).expanduser().resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".{out.name}.titan-export.{os.getpid()}.", suffix=".tmp",
                                 dir=out.parent))


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as exc:
        if not path.is_dir() or exc.errno != errno.EINVAL:  # some file systems cannot sync a folder
            raise
    finally:
        os.close(fd)


def _sync_tree(folder: Path) -> None:
    """Every file under ``folder`` on disk, then the folders (their entries)."""
    paths = sorted(folder.rglob("*"), key=lambda p: -len(p.parts))  # deepest first
    for p in paths:
        if p.is_file() and not p.is_symlink():
            _fsync(p)
    for p in [*paths, folder]:
        if p.is_dir() and not p.is_symlink():
            _fsync(p)


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one step (Linux ``renameat2(RENAME_EXCHANGE)``); False where the
    system or the file system cannot (then nothing moved)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def publish_dir(tmp: str | os.PathLike, out: str | os.PathLike, kind: str) -> Path:
    """Mark ``tmp`` as an export of ``kind`` and put it in place of ``out``: ``out``
    absent or empty, or an earlier export of the same kind (claimed before with
    ``overwrite``), which is then removed. Refuses (``ConfigError``) anything else.
    The files are on disk before the marker, and the marker before the swap."""
    if kind not in KINDS:
        raise ValueError(f"export kind {kind!r} is not one of {KINDS}")
    tmp = Path(tmp)
    out = Path(out).expanduser().resolve()
    if out in _never_replaced({}):
        raise ConfigError(f"--out {out}: an export never replaces this folder; choose a new folder")
    replace = out.is_dir() and any(out.iterdir())
    if replace and export_kind(out) != kind:
        raise ConfigError(f"--out {out}: is not empty and not an earlier {kind} export; not replaced")
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out}: exists and is not a folder; not replaced")
    _sync_tree(tmp)  # a marker on disk must never stand beside files that are not
    with open(tmp / MARKER, "w") as f:
        f.write(json.dumps({"kind": kind, "id": uuid.uuid4().hex}) + "\n")  # the id: _held
        f.flush()
        os.fsync(f.fileno())
    _fsync(tmp)
    old = None
    if not replace:
        if out.is_dir():
            out.rmdir()
        os.replace(tmp, out)
    elif _exchange(tmp, out):
        old = tmp  # now holds the earlier export
    else:
        old = tmp.with_suffix(".old")
        os.replace(out, old)
        try:
            os.replace(tmp, out)
        except BaseException:
            os.replace(old, out)  # never leave ``out`` missing
            raise
    with contextlib.suppress(OSError):  # the swap is done: its entry on disk is a best effort here
        _fsync(out.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return out


def plain_modes(folder: Path) -> None:
    """Files and the folder with the usual permissions (umask), not safetensors' or
    mkdtemp's owner-only 0600/0700."""
    umask = os.umask(0)
    os.umask(umask)
    folder.chmod(0o777 & ~umask)
    for f in folder.iterdir():
        if f.is_file():
            f.chmod(0o666 & ~umask)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a killed child its parent has not reaped yet is gone too
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def _remove_stale(out: Path) -> None:
    """The staging folders a killed export of ``out`` left beside it. Called with the
    lock held, so their writer is gone; only folders of ours (their name) are removed,
    and none named after a process alive here."""
    for p in out.parent.iterdir():
        m = _STAGING.fullmatch(p.name)
        if m is None or m["name"] != out.name or p.is_symlink() or not p.is_dir():
            continue
        if int(m["pid"]) != os.getpid() and _alive(int(m["pid"])):
            continue
        shutil.rmtree(p, ignore_errors=True)


@contextlib.contextmanager
def _locked(out: Path, given: str) -> Iterator[None]:
    """An exclusive ``flock`` on ``.NAME.titan-export.lock`` beside ``out`` for the block;
    a ``ConfigError`` when another export holds it. The file is removed on release
    (while still held: a waiter that opened the old one sees that and takes a new one)."""
    lock = out.with_name(f".{out.name}{LOCK}")
    out.parent.mkdir(parents=True, exist_ok=True)
    for _ in range(100):
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pid = os.pread(fd, 32, 0).decode(errors="replace").strip()
            os.close(fd)
            raise ConfigError(f"{given}: another export (pid {pid or '?'}) is writing it now; "
                              "wait for it to end or choose another folder") from None
        except BaseException:
            os.close(fd)
            raise
        try:
            current = os.stat(lock)
        except FileNotFoundError:
            current = None
        mine = os.fstat(fd)
        if current is not None and (current.st_dev, current.st_ino) == (mine.st_dev, mine.st_ino):
            break
        os.close(fd)  # its holder removed it as we opened it: take the new one
    else:
        raise ConfigError(f"{given}: could not take its lock {lock}; try again")
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        yield
    finally:
        with contextlib.suppress(OSError):
            lock.unlink()
        os.close(fd)


def write_export(out: str | os.PathLike, kind: str, fill: Callable[[Path], None]) -> Path:
    """An export of ``kind`` at ``out`` (claimed before: ``claim_out_dir``): ``fill``
    writes the files into a new staging folder next to ``out``, which then replaces
    ``out`` (``publish_dir``). Nothing but the staging folder is removed on failure.
    Holds ``out``'s lock throughout; refuses when another export replaced ``out``
    since it was claimed; an OS error (a full or read-only disk) is an ``OutDirError``."""
    out = Path(out).expanduser().resolve()
    claim = _CLAIMED.pop(out, None)
    given = claim[0] if claim is not None else f"--out {out}"
    try:
        with _locked(out, given):
            if claim is not None and _held(out) != claim[1]:
                raise ConfigError(f"{given}: another export was written there while this one ran; "
                                  "not replaced (run this one again to replace it)")
            _remove_stale(out)
            tmp = staging_dir(out)
            try:
                fill(tmp)
                plain_modes(tmp)
                return publish_dir(tmp, out, kind)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)  # left only if writing or publishing failed
    except Exception as exc:
        if isinstance(exc, ConfigError):
            raise
        os_error = next(os_errors_behind(exc), None)
        if os_error is None:
            raise
        name = errno.errorcode.get(os_error.errno, str(os_error.errno))
        raise OutDirError(f"{given}: cannot write the export: {os_error.strerror or os_error} ({name}); "
                          f"{out} is as it was") from exc
