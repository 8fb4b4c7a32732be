"""May an export write (or replace) this output folder? The one policy every writer of
a Hugging Face folder follows (``titan-export``, ``checkpoint.export_hf``, the merged
and PEFT-adapter writers), so that no export ever deletes what a user keeps.

    claim_out_dir(out, "full", overwrite=args.overwrite, protect={"the run directory": run_dir})
    write_export(out, "full", fill)   # fill(tmp) writes into a fresh folder next to ``out``,
                                      # which is then marked and swapped in

``write_export`` is ``staging_dir`` -> ``fill`` -> plain file modes -> ``publish_dir``,
removing the staging folder whatever happens; every kind of export goes through it.

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
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path

from titan_plugins.errors import ConfigError

__all__ = ["KINDS", "MARKER", "claim_out_dir", "export_kind", "publish_dir", "staging_dir", "write_export"]

MARKER = ".titan-export.json"
KINDS = ("full", "merged", "peft-adapter")


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
        return path
    if not path.is_dir():
        raise ConfigError(f"{given}: exists and is not a folder; choose a new folder")
    if not any(path.iterdir()):
        return path
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
    return path


def staging_dir(out: str | os.PathLike) -> Path:
    """A new empty folder next to ``out`` (same file system) to write the export into;
    never a folder that existed before."""
    out = Path(out).expanduser().resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))


def publish_dir(tmp: str | os.PathLike, out: str | os.PathLike, kind: str) -> Path:
    """Mark ``tmp`` as an export of ``kind`` and put it in place of ``out``: ``out``
    absent or empty, or an earlier export of the same kind (claimed before with
    ``overwrite``), which is then removed. Refuses (``ConfigError``) anything else."""
    if kind not in KINDS:
        raise ValueError(f"export kind {kind!r} is not one of {KINDS}")
    tmp = Path(tmp)
    out = Path(out).expanduser().resolve()
    if out in _never_replaced({}):
        raise ConfigError(f"--out {out}: an export never replaces this folder; choose a new folder")
    (tmp / MARKER).write_text(json.dumps({"kind": kind}) + "\n")
    old = None
    if out.is_dir() and any(out.iterdir()):
        if export_kind(out) != kind:
            raise ConfigError(f"--out {out}: is not empty and not an earlier {kind} export; not replaced")
        old = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".old", dir=out.parent))
        os.replace(out, old / out.name)
    elif out.is_dir():
        out.rmdir()
    elif out.exists():
        raise ConfigError(f"--out {out}: exists and is not a folder; not replaced")
    os.replace(tmp, out)
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


def write_export(out: str | os.PathLike, kind: str, fill: Callable[[Path], None]) -> Path:
    """An export of ``kind`` at ``out`` (claimed before: ``claim_out_dir``): ``fill``
    writes the files into a new staging folder next to ``out``, which then replaces
    ``out`` (``publish_dir``). Nothing but the staging folder is removed on failure."""
    tmp = staging_dir(out)
    try:
        fill(tmp)
        plain_modes(tmp)
        return publish_dir(tmp, out, kind)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # left only if writing or publishing failed
