"""Preemption: SIGTERM or SIGUSR1 (SLURM's warning), or a feature's request_checkpoint, becomes a checkpoint at a step
boundary agreed on by every process, then EXIT_PREEMPTED; the same command resumes."""

import contextlib
import signal
import threading
import time

import torch

from src import features

_loop_handlers: list = []  # the running PreemptionSignals' handler, while a training loop runs
_requested = threading.Event()  # request_checkpoint's: for the loops that start later too


def training_loop_running() -> bool:
    """Whether a training loop runs to save the checkpoint that request_checkpoint asks for."""
    return bool(_loop_handlers)


def request_checkpoint() -> bool:
    """A preemption checkpoint at the next agreed step, as SIGTERM asks, from code (a feature's thread), in this
    process's later loops too; returns whether a training loop runs now to save it."""
    _requested.set()  # before the handlers are read: a loop starting meanwhile sees it or is handled
    handlers = list(_loop_handlers)
    for handle in handlers:
        handle()
    return bool(handlers)


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
    AGREE_S = 1.0  # ... unless that is longer than this: slow steps agree sooner, within a few seconds
    TIMED_STEPS = 3  # the steps timed to choose `every`, once

    def __init__(self, accelerator):
        self.alone = accelerator.num_processes == 1
        self.received = False
        self.previous = set_preemption_handler(self.handle)  # the handlers replaced, restored on exit
        _loop_handlers.append(self.handle)
        # request_checkpoint may have read the handlers already; a signal before the loop (noted_from_the_start) is
        # read only once this handler has taken over, so none falls between the two
        if _requested.is_set() or _noted_early.is_set():
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
                features.installed().on_preemption()  # e.g. launcher_watch's line, before the checkpoint
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
        _loop_handlers.remove(self.handle)
        if error_type is None and not self.alone and self.pending is not None:
            self.pending.wait()  # the last all-reduce in flight (not after an error: a peer may be gone)
        restore_handlers(self.previous)
