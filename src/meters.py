"""What the loop measures: the loss window, the step timer, samples/s, memory; src/tracking.py writes them."""

import contextlib
import resource
import time

import torch

from src.config import TrainConfig
from src.errors import TrainingDiverged


def peak_memory_gb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # kilobytes on Linux


class LossWindow:
    """Each optimiser step's mean micro-batch loss since the last log (`first_step`: the first's step), kept on the
    device (no host sync per step), averaged over processes at log time; one value per step, so a resume on another
    accumulation count weighs its steps alike. A NaN/inf one stops the run, naming its step, before a checkpoint can
    save damaged weights; with `skip_nonfinite` it is left out (the loop skips its optimiser step)."""

    def __init__(self, accelerator, skip_nonfinite: bool, values: list[float], first_step: int):
        self.accelerator, self.skip_nonfinite, self.first_step = accelerator, skip_nonfinite, first_step
        self.values = [torch.tensor(value, device=accelerator.device) for value in values]

    def add(self, losses: list[torch.Tensor]) -> None:
        """One optimiser step's micro-batch losses."""
        step_loss = losses[0] if len(losses) == 1 else torch.stack(losses).mean()
        self.values.append(step_loss.detach())  # a list append costs less per step than writing into a tensor

    def reduced(self) -> torch.Tensor:
        if not self.values:
            return torch.zeros(0)
        window = torch.stack(self.values).float()
        if self.accelerator.num_processes > 1:  # on one process there is nothing to average
            window = self.accelerator.reduce(window, reduction="mean")
        finite = torch.isfinite(window)
        if bool(finite.all()):
            return window
        if not self.skip_nonfinite:
            bad_step = self.first_step + int((~finite).nonzero()[0])
            raise TrainingDiverged(
                f"the training loss became NaN/inf at step {bad_step}; checkpoints saved before it are intact. "
                "Lower --learning_rate, check the data, or pass --skip_nonfinite_batches true to skip such batches"
            )
        return window[finite]

    def mean(self, next_step: int) -> float:
        window = self.reduced()
        self.values, self.first_step = [], next_step
        return window.mean().item() if window.numel() else float("nan")


class StepTimer:
    """Seconds per optimiser step since `restart(step)`, evaluation and checkpoints left out (`paused()`). It counts its
    own steps: a resumed loss window holds steps the clock didn't see."""

    def __init__(self, step: int):
        self.restart(step)

    def restart(self, step: int) -> None:
        self.start, self.start_step = time.perf_counter(), step

    def seconds_per_step(self, step: int) -> float:
        return (time.perf_counter() - self.start) / max(step - self.start_step, 1)

    @contextlib.contextmanager
    def paused(self):
        paused_at = time.perf_counter()
        yield
        self.start += time.perf_counter() - paused_at


def local_bytes(tensor: torch.Tensor) -> int:
    """This process's bytes of a tensor: a DTensor's local shard, a ZeRO-3 partition (`ds_tensor`; `.data` is empty)."""
    from torch.distributed.tensor import DTensor

    if isinstance(tensor, DTensor):
        tensor = tensor.to_local()
    tensor = getattr(tensor, "ds_tensor", tensor)
    return tensor.numel() * tensor.element_size()


class TrainMeters:
    """What the loop records between two log steps, and a log step's `train/` metrics."""

    def __init__(self, accelerator, model, optimizer: torch.optim.Optimizer, config: TrainConfig, state):
        self.accelerator, self.model, self.optimizer = accelerator, model, optimizer
        self.global_batch = state.global_batch
        self.losses = LossWindow(accelerator, config.skip_nonfinite_batches, state.loss_window, state.window_first_step)
        self.timer = StepTimer(state.step)
        self.skipped_steps = state.skipped_steps if config.skip_nonfinite_batches else None  # with it only
        self.shard_bytes_logged = False

    def log_step(self, step: int, lr: float, grad_norm: torch.Tensor | None, epoch: float) -> dict:
        train_loss = self.losses.mean(next_step=step + 1)  # waits for the device: time after it
        step_time = self.timer.seconds_per_step(step)
        self.timer.restart(step)
        return {
            "train/loss": train_loss,
            "train/lr": lr,
            **({"train/grad_norm": grad_norm.item()} if grad_norm is not None else {}),
            "train/samples_per_s": self.global_batch / step_time,
            "train/step_time_s": step_time,
            "train/peak_memory_gb": peak_memory_gb(self.accelerator.device),
            "epoch": epoch,
            **({"train/skipped_steps": self.skipped_steps} if self.skipped_steps is not None else {}),
            **self.shard_bytes(),
        }

    def shard_bytes(self) -> dict:
        """Proof that a strategy shards: the largest per-process parameter and optimiser-state bytes (what must fit on
        each device), at a start's first log step (optimiser state exists after a step), then {}; collective."""
        if self.shard_bytes_logged:
            return {}
        self.shard_bytes_logged = True
        # the torch optimizer handed to `prepare`: DeepSpeed's ZeRO optimizer and FSDP2 keep this process's part in it
        states = [t for state in self.optimizer.state.values() for t in state.values() if torch.is_tensor(t)]
        held = [sum(map(local_bytes, self.model.parameters())), sum(map(local_bytes, states))]
        sizes = torch.tensor([held], dtype=torch.float64, device=self.accelerator.device)
        largest = self.accelerator.gather(sizes).amax(dim=0).tolist()
        return {"memory/param_bytes": int(largest[0]), "memory/optimizer_state_bytes": int(largest[1])}

    def save_to(self, state) -> None:
        """The partial loss window and the skipped steps into the trainer state, for a checkpoint (a NaN in the window
        stops the run here)."""
        state.loss_window, state.window_first_step = self.losses.reduced().tolist(), self.losses.first_step
        state.skipped_steps = self.skipped_steps or 0
