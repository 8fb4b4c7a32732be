"""Errors a user can cause. Each one prints as one line and exits with code 2."""

from __future__ import annotations

import errno
import os
import re
from collections.abc import Iterator


class TitanError(Exception):
    """Base class: the CLI prints ``error: <message>`` and exits 2, no traceback."""

    exit_code = 2


class ConfigError(TitanError):
    """A configuration value is wrong. The message names the key and the value."""


class PluginLoadError(TitanError):
    """A plugin could not be loaded or registered."""


class DuplicateModelError(PluginLoadError):
    """Two plugins claim the same model name."""


class UnknownModelError(ConfigError):
    """No installed plugin provides the requested model."""


def os_errors_behind(exc: BaseException) -> Iterator[OSError]:
    """The OS errors behind ``exc``, nearest first: itself, its cause/context chain, the
    per-rank failures torch.distributed.checkpoint collects, and errors a library only
    reported as text (safetensors: ``... (os error 28)``; ``[Errno 28]``; "No space left on
    device"). What a full or read-only disk looks like by the time it reaches us."""
    seen: set[int] = set()
    todo: list[BaseException] = [exc]
    while todo:
        e = todo.pop(0)
        if id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno is not None:
            yield e
        todo += [x for x in (e.__cause__, e.__context__) if x is not None]
        failures = getattr(e, "failures", None)  # CheckpointException: rank -> exception (or traceback wrapper)
        if isinstance(failures, dict):
            for f in failures.values():
                inner = f[0] if isinstance(f, tuple) else getattr(f, "exc", f)
                if isinstance(inner, BaseException):
                    todo.append(inner)
                elif "No space left on device" in str(f):
                    yield OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        text = str(e)
        m = re.search(r"\(os error (\d+)\)|\[Errno (\d+)\]", text)
        if m:
            code = int(m[1] or m[2])
            yield OSError(code, os.strerror(code))
        if "No space left on device" in text:
            yield OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
