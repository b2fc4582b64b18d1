"""One way to report bad input: an `error: ...` line on stderr and exit code 2, not a traceback."""

import functools
import os
import sys


class UsageError(Exception):
    """The user's input is wrong (config, flags, data, paths). The message names the problem and the fix."""


EXIT_USAGE = 2


def debug_requested(argv: list[str] | None = None) -> bool:
    """`--debug` on the command line or TRAIN_DEBUG=1 shows full tracebacks instead of one-line errors."""
    argv = sys.argv[1:] if argv is None else argv
    return "--debug" in argv or os.environ.get("TRAIN_DEBUG", "") not in ("", "0")


def exit_on_usage_error(fn):
    """Wrap a command-line entry point: UsageError -> one `error:` line on stderr and exit code 2."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except UsageError as err:
            if debug_requested():
                raise
            print(f"error: {err}", file=sys.stderr, flush=True)
            sys.exit(EXIT_USAGE)

    return wrapper
