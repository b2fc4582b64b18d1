"""Preemption: SIGTERM or SIGUSR1 (SLURM's warning before the time limit) becomes a checkpoint at a step boundary,
agreed on by every process; the run then exits with EXIT_PREEMPTED and the same command resumes it. A launcher that
dies (SIGKILL, the OOM killer) takes the same path: its processes never train on unsupervised (`watch_launcher`)."""

import contextlib
import os
import signal
import threading
import time

import torch

from src.errors import EXIT_LAUNCHER_GONE, is_main_process, say


class LauncherWatch:
    """A thread that stops this process within seconds of its launcher's death (docs/resume.md). torch elastic starts
    each rank in a session of its own, so a launcher killed with SIGKILL takes none along; its agent is this rank's
    parent, so a new parent means it is gone. Polling, not prctl(PR_SET_PDEATHSIG): that is Linux-only, fires when the
    *thread* that forked the rank exits, and races with a parent that died before the rank set it."""

    POLL_S = 0.5
    GRACE_S = 5.0  # for the preemption checkpoint; a new launch on the folder is still importing torch by then

    def __init__(self, launcher: int):
        self.launcher = launcher
        self.gone = threading.Event()
        self.listeners: list = []  # PreemptionSignals' while a training loop runs
        threading.Thread(target=self.watch, name="launcher-watch", daemon=True).start()

    def watch(self) -> None:
        while os.getppid() == self.launcher:
            time.sleep(self.POLL_S)
        self.gone.set()
        listeners = list(self.listeners)
        if is_main_process():
            with contextlib.suppress(OSError):  # the launcher's pipe may be gone with it
                say(
                    f"the launcher (pid {self.launcher}) exited: "
                    + (f"saving a checkpoint, then stopping (at most {self.GRACE_S:g} s)" if listeners else "stopping")
                )
        for listener in listeners:
            listener()
        if listeners:
            time.sleep(self.GRACE_S)
        os._exit(EXIT_LAUNCHER_GONE)


_watch: LauncherWatch | None = None


def watch_launcher() -> None:
    """In a rank that torch elastic started: stop when the launcher dies (LauncherWatch). Once per process."""
    global _watch
    if _watch is None and "TORCHELASTIC_RUN_ID" in os.environ and "WORLD_SIZE" in os.environ:
        _watch = LauncherWatch(os.getppid())


class PreemptionSignals(contextlib.AbstractContextManager):
    """SIGTERM / SIGUSR1, or the launcher's death, ask for a checkpoint at a step boundary. Processes may receive the
    signal at different steps, so every `every`-th step starts an all-reduce of the flag in the background on a CPU
    (gloo) group and reads the one started `every` steps earlier: every process sees the same sum at the same step and
    no step waits for the network. On GPUs that is every step; CPU processes agree every 10 steps (gloo's background
    work takes cores from training, docs/resume.md). One process needs no agreement."""

    CPU_EVERY = 10
    SIGNALS = ("SIGTERM", "SIGUSR1")

    def __init__(self, accelerator):
        self.alone = accelerator.num_processes == 1
        self.received = False
        self.previous = {}
        for name in self.SIGNALS:
            # ValueError outside the main thread (some notebook runners): then no handler, as before
            with contextlib.suppress(ValueError, AttributeError):
                self.previous[name] = signal.signal(getattr(signal, name), self.handle)
        if _watch is not None:
            _watch.listeners.append(self.handle)
            if _watch.gone.is_set():  # the watch may have read its listeners already
                self.handle()
        if not self.alone:
            self.group = torch.distributed.new_group(backend="gloo")  # a CPU flag: no device sync per step
            self.flag, self.pending = torch.zeros(1), None
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
        self.flag = torch.tensor([float(self.received)])
        self.pending = torch.distributed.all_reduce(self.flag, group=self.group, async_op=True)
        return agreed

    def __exit__(self, error_type, error, traceback):
        """Restore the handlers we replaced, also when training raised: a notebook's kernel keeps its own."""
        if _watch is not None and self.handle in _watch.listeners:
            _watch.listeners.remove(self.handle)
        if error_type is None and not self.alone and self.pending is not None:
            self.pending.wait()  # the last all-reduce in flight (not after an error: a peer may be gone)
        for name, handler in self.previous.items():
            signal.signal(getattr(signal, name), handler)
