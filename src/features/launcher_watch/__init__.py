"""A torch elastic rank never outlives its launcher (docs/resume.md): once the launcher dies (SIGKILL, the OOM killer),
the rank saves a preemption checkpoint at the next step the ranks agree on, or stops at once outside a training loop,
and exits EXIT_LAUNCHER_GONE."""

import atexit
import contextlib
import os
import sys
import threading
import time
from pathlib import Path

from src import preemption
from src.errors import is_main_process, say
from src.features import Feature

EXIT_LAUNCHER_GONE = 129  # 128 + SIGHUP, as a process whose terminal hung up (no launcher is left to read it)
POLL_S = 0.5
GRACE_S = 5.0  # for the preemption checkpoint; a new launch on the folder is still importing torch by then
_launcher_gone = threading.Event()
_launcher: list[int] = []  # the watched launcher's pid, once watch_launcher has started watching
_noticing = threading.Lock()


class LauncherWatch(Feature):
    def before_process_group(self) -> None:
        watch_launcher()

    def on_preemption(self) -> None:
        launcher_gone()  # if that is why: said now, before the checkpoint, whichever rank noticed it


def watch_launcher() -> None:
    """Once, in a torch elastic rank (in a session of its own: a SIGKILLed launcher takes none along): a thread that
    stops the rank soon after its parent changes, or at once if its parent is no launcher already (docs/resume.md).
    Polling: PR_SET_PDEATHSIG is Linux-only, fires when the *thread* that forked the rank exits, and races with a
    parent that died first."""
    if not _launcher and "TORCHELASTIC_RUN_ID" in os.environ and "WORLD_SIZE" in os.environ:
        parent = os.getppid()
        _launcher.append(parent if runs_python(parent) else GONE_BEFORE_WATCHED)
        threading.Thread(target=watch, name="launcher-watch", daemon=True).start()
        atexit.register(exit_now_if_launcher_gone)


GONE_BEFORE_WATCHED = 0  # no process's pid: the launcher died while this rank started (e.g. importing torch)


def runs_python(pid: int) -> bool:
    """Whether process `pid` runs Python, as every launcher of a torch elastic rank does; a rank whose parent does not
    was handed to init (or a subreaper) by a launcher that died before it was watched. True where it can't be told."""
    try:  # its program (a launcher script's interpreter: the kernel puts it first); /proc/PID/exe may be unreadable
        program = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0]
    except OSError:  # no /proc (macOS)
        return True
    return b"python" in os.path.basename(program)


def exit_now_if_launcher_gone() -> None:
    """At interpreter exit with the launcher gone, stop now: teardown can wait seconds on a gone peer, and once it has
    begun the watch thread can no longer run to end it."""
    if _launcher_gone.is_set():
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError):  # a closed pipe, a closed file
                stream.flush()
        os._exit(EXIT_LAUNCHER_GONE)


def launcher_gone() -> bool:
    """Whether the watched launcher is gone; the first to find it (the watch thread, or the loop once the ranks agreed
    to stop) says so and sets `_launcher_gone`."""
    if not _launcher or os.getppid() == _launcher[0]:
        return False
    with _noticing:
        if not _launcher_gone.is_set():
            saving = preemption.training_loop_running()
            then = f"saving a checkpoint, then stopping (at most {GRACE_S:g} s)" if saving else "stopping"
            launcher = "the launcher" if _launcher[0] == GONE_BEFORE_WATCHED else f"the launcher (pid {_launcher[0]})"
            if is_main_process():
                with contextlib.suppress(OSError):  # the launcher's pipe may be gone with it
                    say(f"{launcher} exited: {then}")
            _launcher_gone.set()  # said first: from here on, an exit is immediate (exit_now_if_launcher_gone)
    return True


def watch() -> None:
    while not launcher_gone():
        time.sleep(POLL_S)
    if preemption.request_checkpoint():  # a training loop saves it at the next agreed step, within GRACE_S
        time.sleep(GRACE_S)
    os._exit(EXIT_LAUNCHER_GONE)


FEATURE = LauncherWatch()
