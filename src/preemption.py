"""Preemption: SIGTERM or SIGUSR1 (SLURM's warning), or the launcher's death (SIGKILL, the OOM killer), becomes a
checkpoint at a step boundary agreed on by every process, then EXIT_PREEMPTED; the same command resumes."""

import atexit
import contextlib
import os
import signal
import sys
import threading
import time
from pathlib import Path

import torch

from src.errors import EXIT_LAUNCHER_GONE, is_main_process, say

POLL_S = 0.5
GRACE_S = 5.0  # for the preemption checkpoint; a new launch on the folder is still importing torch by then
_launcher_gone = threading.Event()
_launcher_listeners: list = []  # PreemptionSignals' while a training loop runs
_launcher: list[int] = []  # the watched launcher's pid, once watch_launcher has started watching
_noticing = threading.Lock()


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
            then = f"saving a checkpoint, then stopping (at most {GRACE_S:g} s)" if _launcher_listeners else "stopping"
            launcher = "the launcher" if _launcher[0] == GONE_BEFORE_WATCHED else f"the launcher (pid {_launcher[0]})"
            if is_main_process():
                with contextlib.suppress(OSError):  # the launcher's pipe may be gone with it
                    say(f"{launcher} exited: {then}")
            _launcher_gone.set()  # said first: from here on, an exit is immediate (exit_now_if_launcher_gone)
    return True


def watch() -> None:
    while not launcher_gone():
        time.sleep(POLL_S)
    listeners = list(_launcher_listeners)
    for listener in listeners:
        listener()
    if listeners:
        time.sleep(GRACE_S)
    os._exit(EXIT_LAUNCHER_GONE)


_noted_early = threading.Event()  # a signal before the training loop's PreemptionSignals, kept for it


@contextlib.contextmanager
def noted_from_the_start():
    """SIGTERM/SIGUSR1 that come before the training loop (a job preempted as it reads its data or builds its model)
    are kept for it: it checkpoints at its first agreed step, so that a requeued job is requeued again (a killed one
    saves nothing: scripts/slurm/requeue_if_preempted.sh would end the chain). The handlers before are put back."""
    previous = set_preemption_handler(lambda *_: _noted_early.set())
    try:
        yield
    finally:
        restore_handlers(previous)
        _noted_early.clear()


@contextlib.contextmanager
def signals_as_default():
    """SIGTERM and SIGUSR1 end the process inside, as by default: kept for a checkpoint, they would leave a process
    waiting for a peer that will never come (the launcher's SIGTERM after that peer failed) until a SIGKILL."""
    previous = set_preemption_handler(signal.SIG_DFL)
    try:
        yield
    finally:
        restore_handlers(previous)


def set_preemption_handler(handler) -> dict:
    """`handler` for SIGTERM and SIGUSR1 from now on (none off the main thread); returns the handlers it replaced."""
    previous = {}
    for name in ("SIGTERM", "SIGUSR1"):
        with contextlib.suppress(ValueError, AttributeError):  # ValueError off the main thread: no handler
            previous[name] = signal.signal(getattr(signal, name), handler)
    return previous


def restore_handlers(previous: dict) -> None:
    for name, handler in previous.items():
        signal.signal(getattr(signal, name), handler)


class PreemptionSignals(contextlib.AbstractContextManager):
    """Processes may be signalled at different steps: every `every`-th step starts a background gloo all-reduce of the
    flag and reads the one started `every` steps earlier, so all agree at the same step and none waits."""

    CPU_EVERY = 10  # `every` on CPU processes (1 on GPUs): gloo's background work takes cores (docs/resume.md) ...
    AGREE_S = 1.0  # ... unless that is longer than this: slow steps agree sooner, well within GRACE_S
    TIMED_STEPS = 3  # the steps timed to choose `every`, once

    def __init__(self, accelerator):
        self.alone = accelerator.num_processes == 1
        self.received = False
        self.previous = set_preemption_handler(self.handle)  # the handlers replaced, restored on exit
        _launcher_listeners.append(self.handle)
        # the watch may have read its listeners already; a signal before the loop (noted_from_the_start) is read
        # only once this handler has taken over, so none falls between the two
        if _launcher_gone.is_set() or _noted_early.is_set():
            self.handle()
        if not self.alone:
            self.group = torch.distributed.new_group(backend="gloo")  # a CPU flag: no device sync per step
            self.pending = None  # the all-reduce in flight, of self.flag
            self.every = self.CPU_EVERY if accelerator.device.type == "cpu" else 1
            self.calls = 0  # requested()'s calls, while the first steps are timed

    def handle(self, *signal_and_frame):
        self.received = True

    def requested(self, step: int) -> bool:
        """Call once per step on every process; True on all of them at the same step once any was signalled."""
        if self.alone:
            return self.received
        if self.every > 1 and self.calls <= self.TIMED_STEPS:  # the first steps timed once, then `every` chosen
            self.calls += 1
            if self.calls == 1:
                self.started = time.perf_counter()  # the first step (compiling, warming up) left out
            elif self.calls == self.TIMED_STEPS + 1:
                self.every = self.agreed_every((time.perf_counter() - self.started) / self.TIMED_STEPS)
        if step % self.every:
            return False
        agreed = False
        if self.pending is not None:
            self.pending.wait()
            agreed = bool(self.flag.item() > 0)
            if agreed:
                launcher_gone()  # if that is why: said now, before the checkpoint, whichever rank noticed it
        self.flag = torch.tensor([float(self.received)])
        self.pending = torch.distributed.all_reduce(self.flag, group=self.group, async_op=True)
        return agreed

    def agreed_every(self, seconds_per_step: float) -> int:
        """CPU_EVERY steps, or fewer where they take longer than AGREE_S on the slowest process; the same on all: the
        same call on each (a collective once, at the same step)."""
        slowest = torch.tensor([seconds_per_step])
        torch.distributed.all_reduce(slowest, op=torch.distributed.ReduceOp.MAX, group=self.group)
        return max(1, min(self.CPU_EVERY, int(self.AGREE_S / max(slowest.item(), 1e-9))))

    def __exit__(self, error_type, error, traceback):
        """Restore the handlers we replaced, also when training raised: a notebook's kernel keeps its own."""
        _launcher_listeners.remove(self.handle)
        if error_type is None and not self.alone and self.pending is not None:
            self.pending.wait()  # the last all-reduce in flight (not after an error: a peer may be gone)
        restore_handlers(self.previous)
