"""How a run ends when it does not finish: one line and a documented exit code, not a traceback.

| exit code | meaning |
| --- | --- |
| 0  | trained to the end |
| 2  | bad input (config, flags, data, paths): the `error:` line names the problem and the fix |
| 75 | preempted (SIGTERM/SIGUSR1): a checkpoint was saved; run the same command to resume (requeue) |
| 130 | interrupted (Ctrl-C) |
"""

import functools
import os
import sys

EXIT_USAGE = 2
EXIT_PREEMPTED = 75  # EX_TEMPFAIL from sysexits.h: "temporary failure, try again"
EXIT_INTERRUPTED = 130  # 128 + SIGINT, what shells report for Ctrl-C


class UsageError(Exception):
    """The user's input is wrong (config, flags, data, paths). The message names the problem and the fix."""


class TrainingPreempted(Exception):
    """Raised once the preemption checkpoint is on disk."""


def debug_requested(argv: list[str] | None = None) -> bool:
    """`--debug true` on the command line or TRAIN_DEBUG=1 shows full tracebacks instead of one-line errors."""
    argv = sys.argv[1:] if argv is None else argv
    return "--debug" in argv or os.environ.get("TRAIN_DEBUG", "") not in ("", "0")


def command_line(fn):
    """Wrap a command-line entry point so each way of stopping early gets its line and exit code."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except UsageError as err:
            if debug_requested():
                raise
            print(f"error: {err}", file=sys.stderr, flush=True)
            sys.exit(EXIT_USAGE)
        except TrainingPreempted as err:
            print(f"preempted: {err}", file=sys.stderr, flush=True)
            sys.exit(EXIT_PREEMPTED)
        except KeyboardInterrupt:
            print("interrupted (Ctrl-C): stopped without saving", file=sys.stderr, flush=True)
            sys.exit(EXIT_INTERRUPTED)

    return wrapper
