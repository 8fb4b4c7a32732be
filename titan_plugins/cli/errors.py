"""Turn the errors a user can cause into one line and exit code 2."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Sequence
from typing import TypeVar

from titan_plugins.errors import TitanError

F = TypeVar("F", bound=Callable[..., int | None])


def error_line(message: object) -> str:
    """``error: <message>`` on one line."""
    text = " ".join(part.strip() for part in str(message).splitlines() if part.strip())
    return f"error: {text}"


def main_wrapper(func: Callable[[Sequence[str] | None], int | None]) -> Callable[..., int]:
    """Wrap a CLI ``main(argv)``: a ``TitanError`` prints ``error: <msg>`` on
    stderr and returns its exit code (2) instead of a traceback."""

    @functools.wraps(func)
    def wrapper(argv: Sequence[str] | None = None) -> int:
        try:
            return func(argv) or 0
        except TitanError as exc:
            print(error_line(exc), file=sys.stderr)
            return exc.exit_code
        except KeyboardInterrupt:
            print("error: interrupted", file=sys.stderr)
            return 130
        except BrokenPipeError:  # `titan-plugins list | head`
            return 0

    return wrapper
