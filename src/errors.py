"""How a run ends early: one line and a documented exit code (docs/errors.md), not a traceback (unless --debug)."""

import functools
import os
import sys
import time
from pathlib import Path

EXIT_USAGE = 2  # bad input (config, flags, data, paths, a launch this machine can't run): the line names the fix
EXIT_DIVERGED = 65  # the loss became NaN/inf (earlier checkpoints are intact); EX_DATAERR from sysexits.h
EXIT_TASK_FAILED = 70  # the task's code failed (its data, model, a batch): the line names the hook; EX_SOFTWARE
EXIT_WRITE_FAILED = 74  # a checkpoint could not be written or uploaded (the previous are intact); EX_IOERR
EXIT_PREEMPTED = 75  # preempted, a checkpoint saved: run the same command to resume; EX_TEMPFAIL, "try again"
EXIT_INTERRUPTED = 130  # 128 + SIGINT, what shells report for Ctrl-C
DOCUMENTED_EXIT_CODES = (EXIT_USAGE, EXIT_DIVERGED, EXIT_TASK_FAILED, EXIT_WRITE_FAILED, EXIT_PREEMPTED)
DOCUMENTED_EXIT_CODES += (EXIT_INTERRUPTED,)  # those of a run that said why: not 1 (unexpected)


class RunStopped(Exception):
    """A run ending early for a known reason: its message is the one line shown, `exit_code` the status."""

    exit_code = 1
    prefix = "error"
    main_process_only = False  # True: the same on every process: said once even with no launcher's folder
    said_elsewhere = False  # True: another process says why (e.g. its checkpoint write failed); this one is quiet


class UsageError(RunStopped):
    """The user's input is wrong (config, flags, data, paths); the message names the problem and the fix."""

    exit_code = EXIT_USAGE


class LaunchError(UsageError):
    """A launch this machine can't run: every process finds it, the first says it."""

    main_process_only = True


class TrainingDiverged(RunStopped):
    exit_code = EXIT_DIVERGED


class TaskFailed(RunStopped):
    exit_code = EXIT_TASK_FAILED


class CheckpointWriteFailed(RunStopped):
    exit_code = EXIT_WRITE_FAILED


class TrainingPreempted(RunStopped):
    """Raised once the preemption checkpoint is on disk."""

    exit_code = EXIT_PREEMPTED
    prefix = "preempted"


RANKS = ("RANK", "PMI_RANK", "OMPI_COMM_WORLD_RANK", "MV2_COMM_WORLD_RANK")  # torchrun's, MPI's: Accelerate's order


def is_main_process() -> bool:
    """Before the process group forms: what the first rank variable set says."""
    return next((os.environ[name] for name in RANKS if name in os.environ), "0") == "0"


def say(line: str) -> None:
    """In one write: print writes the newline apart, and lines of processes sharing a terminal would interleave."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def first_to_say(main_process_only: bool = False) -> bool:
    """Whether this process says why the launch stopped: the first to stop does (the launcher stops the rest once one
    exits: left to rank 0 the line could be lost), and the others' lines would only repeat it (the same error with
    their own numbers, a peer gone). A file made exclusively in <attempt> of TORCHELASTIC_ERROR_FILE=<attempt>/<rank>/
    error.json, which a node's ranks share. Without it: every process says it, or only the main one if
    `main_process_only`."""
    if error_file := os.environ.get("TORCHELASTIC_ERROR_FILE"):
        try:
            (Path(error_file).parent.parent / "said").touch(exist_ok=False)
            return True
        except FileExistsError:
            return False
        except OSError:  # no such folder: as without a launcher
            pass
    return is_main_process() or not main_process_only


def let_threads_settle(num_processes: int | None = None) -> None:
    """Sleep 50 ms, GIL released, after the last collective on N processes (default WORLD_SIZE): freeing the DDP model
    ends gloo's group, joining its threads while holding the GIL one of them needs: a hang (pytorch#56297)."""
    if (num_processes or int(os.environ.get("WORLD_SIZE", "1"))) > 1:
        time.sleep(0.05)


_show_tracebacks = False


def show_tracebacks(on: bool) -> None:
    """--debug true: command_line raises instead of saying one line; src/cli.py sets it from the command line and
    --config files before it parses them (their own errors too)."""
    global _show_tracebacks
    _show_tracebacks = on


def debugging() -> bool:
    return _show_tracebacks or os.environ.get("TRAIN_DEBUG", "") not in ("", "0")


def command_line(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except RunStopped as err:
            if debugging() and not isinstance(err, TrainingPreempted):  # preempted: exit 75 all the same, to requeue
                raise
            if not err.said_elsewhere and first_to_say(err.main_process_only):
                say(f"{err.prefix}: {err}")
            let_threads_settle()
            sys.exit(err.exit_code)
        except KeyboardInterrupt:  # Ctrl-C reaches every process of a launch: said by one
            if first_to_say():
                say("interrupted (Ctrl-C): stopped without saving")
            let_threads_settle()
            sys.exit(EXIT_INTERRUPTED)
        except Exception as err:
            if not peer_lost(err) or debugging():
                raise
            if first_to_say():  # none said why: the process that stopped first was killed, or on another node
                say("error: another process of this launch stopped (killed, or failed on another node), and this one "
                    "with it; the launcher's report names it")  # fmt: skip
            let_threads_settle()
            sys.exit(1)

    return wrapper


def peer_lost(err: Exception) -> bool:
    """Whether `err` is a collective losing a process of the launch (gloo: "Connection closed by peer"), which stops
    every other process once one stops: that one says why."""
    distributed = sys.modules.get("torch.distributed")
    if int(os.environ.get("WORLD_SIZE", "1")) < 2 or distributed is None:
        return False
    if isinstance(err, getattr(distributed, "DistNetworkError", ())):  # not all DistErrors: NCCL's own say more
        return True
    return isinstance(err, RuntimeError) and any(f"Connection {how} by peer" in str(err) for how in ("closed", "reset"))


def one_line(err: Exception) -> str:
    return " ".join(str(err).split())


def describe(value, depth: int = 0) -> str:
    """A batch's structure in one line: `(tensor int64 [32, 128], tensor int64 [32])`, dict keys, list lengths."""
    if hasattr(value, "shape") and hasattr(value, "dtype"):
        return f"tensor {str(value.dtype).removeprefix('torch.')} {list(value.shape)}"
    if depth > 2:
        return type(value).__name__
    if hasattr(value, "keys"):
        return "{" + ", ".join(f"{k}: {describe(value[k], depth + 1)}" for k in list(value.keys())[:8]) + "}"
    if isinstance(value, (list, tuple)):
        inner = ", ".join(describe(v, depth + 1) for v in value[:4])
        inner = f"{len(value)} items: {inner}, ..." if len(value) > 4 else inner
        return f"({inner})" if isinstance(value, tuple) else f"[{inner}]"
    return type(value).__name__
