"""Preemption: SIGTERM or SIGUSR1 (SLURM's warning before the time limit) becomes a checkpoint at a step boundary,
agreed on by every process; the run then exits with EXIT_PREEMPTED and the same command resumes it. A launcher that
dies (SIGKILL, the OOM killer) takes the same path: its processes never train on unsupervised (`watch_launcher`)."""

import atexit
import contextlib
import os
import signal
import sys
import threading
import time

import torch

from src.errors import EXIT_LAUNCHER_GONE, is_main_process, say

POLL_S = 0.5
GRACE_S = 5.0  # for the preemption checkpoint; a new launch on the folder is still importing torch by then
_launcher_gone = threading.Event()
_launcher_listeners: list = []  # PreemptionSignals' while a training loop runs
_launcher: list[int] = []  # the watched launcher's pid, once watch_launcher has started watching
_noticing = threading.Lock()


def watch_launcher() -> None:
    """In a rank torch elastic started (each in a session of its own, so a launcher killed with SIGKILL takes none
    along), once: a thread that stops the rank within seconds of its parent, the launcher's agent, changing
    (docs/resume.md). Polling, not prctl(PR_SET_PDEATHSIG): that is Linux-only, fires when the *thread* that forked
    the rank exits, and races with a parent that died before the rank set it."""
    if not _launcher and "TORCHELASTIC_RUN_ID" in os.environ and "WORLD_SIZE" in os.environ:
        _launcher.append(os.getppid())
        threading.Thread(target=watch, name="launcher-watch", daemon=True).start()
        atexit.register(exit_now_if_launcher_gone)


def exit_now_if_launcher_gone() -> None:
    """At interpreter exit with the launcher gone (an error raised once a peer stopped, or the preemption path's exit):
    stop now. The interpreter's teardown (a process group's, waiting on that peer) can take seconds, and once it has
    begun, the watch thread can no longer run to end it."""
    if _launcher_gone.is_set():
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError):  # a closed pipe, a closed file
                stream.flush()
        os._exit(EXIT_LAUNCHER_GONE)


def launcher_gone() -> bool:
    """Whether the watched launcher is gone. The first to find it gone, the watch thread or the loop (a peer noticed
    first and the ranks agreed to stop: rank 0 says why before its checkpoint), says so and sets `_launcher_gone`."""
    if not _launcher or os.getppid() == _launcher[0]:
        return False
    with _noticing:
        if not _launcher_gone.is_set():
            then = f"saving a checkpoint, then stopping (at most {GRACE_S:g} s)" if _launcher_listeners else "stopping"
            if is_main_process():
                with contextlib.suppress(OSError):  # the launcher's pipe may be gone with it
                    say(f"the launcher (pid {_launcher[0]}) exited: {then}")
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


class PreemptionSignals(contextlib.AbstractContextManager):
    """SIGTERM / SIGUSR1, or the launcher's death, ask for a checkpoint at a step boundary. Processes may be signalled
    at different steps, so every `every`-th step starts a background all-reduce of the flag on a gloo group and reads
    the one started `every` steps earlier: all see the same sum at the same step, and no step waits for the network.
    `every` is 1 on GPUs, 10 on CPU processes (gloo's background work takes cores from training, docs/resume.md)."""

    CPU_EVERY = 10

    def __init__(self, accelerator):
        self.alone = accelerator.num_processes == 1
        self.received, self.previous = False, {}  # previous: the handlers replaced, restored on exit
        for name in ("SIGTERM", "SIGUSR1"):
            # ValueError outside the main thread (some notebook runners): then no handler, as before
            with contextlib.suppress(ValueError, AttributeError):
                self.previous[name] = signal.signal(getattr(signal, name), self.handle)
        _launcher_listeners.append(self.handle)
        if _launcher_gone.is_set():  # the watch may have read its listeners already
            self.handle()
        if not self.alone:
            self.group = torch.distributed.new_group(backend="gloo")  # a CPU flag: no device sync per step
            self.pending = None  # the all-reduce in flight, of self.flag
            self.every = self.CPU_EVERY if accelerator.device.type == "cpu" else 1

    def handle(self, *signal_and_frame):
        self.received = True

    def requested(self, step: int) -> bool:
        """Call once per step on every process; True on all of them at the same step once any was signalled."""
        if self.alone:
            return self.received
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

    def __exit__(self, error_type, error, traceback):
        """Restore the handlers we replaced, also when training raised: a notebook's kernel keeps its own."""
        _launcher_listeners.remove(self.handle)
        if error_type is None and not self.alone and self.pending is not None:
            self.pending.wait()  # the last all-reduce in flight (not after an error: a peer may be gone)
        for name, handler in self.previous.items():
            signal.signal(getattr(signal, name), handler)
