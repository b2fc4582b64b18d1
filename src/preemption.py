"""Preemption: SIGTERM or SIGUSR1 (SLURM's warning before the time limit) becomes a checkpoint at a step boundary,
agreed on by every process; the run then exits with EXIT_PREEMPTED and the same command resumes it."""

import contextlib
import signal

import torch


class PreemptionSignals:
    """SIGTERM / SIGUSR1 (SLURM's warning before the time limit) ask for a checkpoint at a step boundary.

    Processes may receive the signal at different steps, so they must agree on when to save. Every `every`-th step
    starts an all-reduce of the flag, in the background on a CPU (gloo) group, and reads the one started `every`
    steps earlier: every process sees the same sum at the same step and no step waits for the network or the GPU.
    On GPUs that is every step (the checkpoint comes one step after the signal). When the processes train on the CPU,
    gloo's background work takes cores from training (docs/resume.md), so they agree every 10 steps. One process
    needs no agreement and no collective.
    """

    CPU_EVERY = 10

    SIGNALS = ("SIGTERM", "SIGUSR1")

    def __init__(self, accelerator):
        self.alone = accelerator.num_processes == 1
        self.received: str | None = None
        self.previous = {}
        for name in self.SIGNALS:
            # ValueError outside the main thread (some notebook runners): then no handler, as before
            with contextlib.suppress(ValueError, AttributeError):
                self.previous[name] = signal.signal(getattr(signal, name), self.handle)
        if not self.alone:
            import torch.distributed as dist

            self.group = dist.new_group(backend="gloo")  # a CPU flag: no device sync per step
            self.flag, self.pending = torch.zeros(1), None
            self.every = self.CPU_EVERY if accelerator.device.type == "cpu" else 1

    def handle(self, signum, frame):
        self.received = signal.Signals(signum).name

    def requested(self, step: int) -> bool:
        """Call once per step on every process; True on all of them at the same step once any was signalled."""
        if self.alone:
            return self.received is not None
        if step % self.every:
            return False
        import torch.distributed as dist

        agreed = False
        if self.pending is not None:
            self.pending.wait()
            agreed = bool(self.flag.item() > 0)
        self.flag = torch.tensor([float(self.received is not None)])
        self.pending = dist.all_reduce(self.flag, group=self.group, async_op=True)
        return agreed

    def __enter__(self):
        return self

    def __exit__(self, error_type, error, traceback):
        """Restore the handlers we replaced, also when training raised: a notebook's kernel keeps its own."""
        if error_type is None and not self.alone and self.pending is not None:
            self.pending.wait()  # the last all-reduce in flight (not after an error: a peer may be gone)
        for name, handler in self.previous.items():
            signal.signal(getattr(signal, name), handler)
