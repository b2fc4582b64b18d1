"""What the main process alone does: console lines, `metrics.jsonl`, wandb/tensorboard, the progress bar.

The rule lives here, once: `setup_logging` silences every other process's console, Accelerate's `log` and
`init_trackers` already run on the main process only, and the progress bar is disabled elsewhere. The training
loop therefore never asks which rank it is on.
"""

import contextlib
import json
import logging
import netrc
import os
import resource
import shutil
import sys
import time
from pathlib import Path

import torch
from accelerate.tracking import GeneralTracker

from src.config import TrainConfig
from src.errors import UsageError

logger = logging.getLogger(__name__)


def setup_logging(accelerator) -> None:
    """INFO lines from the main process; other processes print errors only (no N copies of every warning)."""
    level = logging.INFO if accelerator.is_main_process else logging.ERROR
    logging.basicConfig(format="%(asctime)s %(message)s", datefmt="%H:%M:%S", level=level, force=True)
    logging.getLogger("accelerate").setLevel(logging.WARNING)  # its INFO lines repeat ours, some wrongly
    if not accelerator.is_main_process:
        import warnings

        warnings.filterwarnings("ignore")


class JsonlTracker(GeneralTracker):
    """An Accelerate tracker writing one JSON object per `accelerator.log` call to `output_dir/metrics.jsonl`."""

    name = "jsonl"
    requires_logging_directory = False
    main_process_only = True

    def __init__(self, path: Path):
        super().__init__()
        self.path = Path(path)
        self.file = None

    @property
    def tracker(self):
        return self.file

    def start(self):  # called by init_trackers on the main process only
        self.file = open(self.path, "a", buffering=1)  # noqa: SIM115 (closed in finish); line-buffered: a kill keeps every line

    def log(self, values: dict, step: int | None = None, **kwargs):
        self.file.write(json.dumps({"step": step, **values}) + "\n")

    def finish(self):
        self.file.close()


def build_trackers(config: TrainConfig) -> list:
    """`log_with` for the Accelerator: metrics.jsonl always, plus whatever --report_to names."""
    return [JsonlTracker(Path(config.output_dir) / "metrics.jsonl"), *config.report_to]


def start_tracking(accelerator, config: TrainConfig, resume_run_id: str | None = None) -> str | None:
    """Start one tracker run (main process); a resumed run continues its wandb run. Returns the wandb run id."""
    wandb_kwargs = {
        "name": config.run_name,
        "dir": config.output_dir,
        "tags": config.run_tags,
        "group": config.run_group,
    }
    if "wandb" in config.report_to:
        configure_wandb(config)
        if resume_run_id:
            wandb_kwargs |= {"id": resume_run_id, "resume": "allow"}
    accelerator.init_trackers(
        config.project_name, config=loggable(config.to_dict()), init_kwargs={"wandb": wandb_kwargs}
    )
    if "wandb" in config.report_to and accelerator.is_main_process:
        return accelerator.get_tracker("wandb", unwrap=True).id
    return resume_run_id


def configure_wandb(config: TrainConfig) -> None:
    """No credentials and no WANDB_MODE: go offline instead of prompting forever (or crashing without a TTY)."""
    if os.environ.get("WANDB_MODE") or has_wandb_credentials():
        return
    os.environ["WANDB_MODE"] = "offline"
    logger.info(
        "wandb: no API key found, logging offline; upload later with `wandb sync %s/wandb/offline-run-*`",
        config.output_dir,
    )


def has_wandb_credentials() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        return netrc.netrc(os.environ.get("NETRC")).authenticators("api.wandb.ai") is not None
    except (FileNotFoundError, netrc.NetrcParseError):
        return False


def loggable(values: dict) -> dict:
    """Trackers take scalars only (tensorboard's hparams); lists and dicts become strings."""
    return {k: v if isinstance(v, (int, float, str, bool)) or v is None else str(v) for k, v in values.items()}


def setup_metrics(accelerator, model, config: TrainConfig, global_batch: int) -> dict:
    """Logged once per start: what a reader of the curves needs to know about the run."""
    import accelerate

    return {
        "setup/parameters": sum(p.numel() for p in model.parameters()),
        "setup/world_size": accelerator.num_processes,
        "setup/per_device_batch": config.per_device_train_batch_size,
        "setup/global_batch": global_batch,
        "setup/gradient_accumulation": accelerator.gradient_accumulation_steps,
        "setup/mixed_precision": accelerator.mixed_precision,
        "setup/device": str(accelerator.device),
        "setup/torch": torch.__version__,
        "setup/accelerate": accelerate.__version__,
    }


def peak_memory_gb(device: torch.device) -> float:
    """Peak CUDA memory allocated on this process's GPU, or the process's peak resident memory elsewhere."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # kilobytes on Linux


def log_metrics(accelerator, metrics: dict, step: int) -> None:
    """To every tracker (metrics.jsonl included) and one console line, main process only."""
    accelerator.log(metrics, step=step)
    logger.info("step %d | %s", step, " | ".join(f"{k} {format_value(v)}" for k, v in metrics.items()))


def format_value(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def progress_bar(accelerator, total: int, initial: int = 0):
    """tqdm on the main process when stdout is a terminal; otherwise the periodic log lines are the progress."""
    from tqdm.auto import tqdm

    enabled = accelerator.is_main_process and sys.stdout.isatty()
    width = shutil.get_terminal_size().columns  # 80 where a pseudo-terminal reports no size (tqdm would draw nothing)
    return tqdm(total=total, initial=initial, disable=not enabled, unit="step", ncols=width)


class LossWindow:
    """The training losses since the last log line, one per micro-batch, kept on the device (no host sync per step).

    `mean()` averages them over all processes at log time. A NaN/inf loss stops the run there, naming the step it
    first appeared at (before any checkpoint could save the damaged weights), unless `skip_nonfinite` is set: then
    such values are left out of the mean (the train loop skips their optimiser steps).
    """

    def __init__(self, accelerator, accumulation: int, skip_nonfinite: bool):
        self.accelerator = accelerator
        self.accumulation = accumulation
        self.skip_nonfinite = skip_nonfinite
        self.values: list[torch.Tensor] = []  # a list append costs less per step than writing into a tensor
        self.first_step = 1  # the optimiser step the first value in the window belongs to

    def add(self, loss: torch.Tensor) -> None:
        self.values.append(loss.detach())

    def reduced(self) -> torch.Tensor:
        """The window's values, each averaged over processes; raises on a non-finite one unless skipping."""
        if not self.values:
            return torch.zeros(0)
        window = self.accelerator.reduce(torch.stack(self.values).float(), reduction="mean")
        finite = torch.isfinite(window)
        if not self.skip_nonfinite and not bool(finite.all()):
            bad_step = self.first_step + int((~finite).nonzero()[0]) // self.accumulation
            raise UsageError(
                f"the training loss became NaN/inf at step {bad_step}; the last checkpoint before it is intact. "
                "Lower --learning_rate, check the data, or pass --skip_nonfinite_batches true to skip such batches"
            )
        return window[finite]

    def mean(self, next_step: int) -> float:
        """Mean over the window and all processes; empties the window."""
        window = self.reduced()
        self.values, self.first_step = [], next_step
        return window.mean().item() if window.numel() else float("nan")

    def state(self) -> list[float]:
        return self.reduced().tolist()

    def load(self, values: list[float], first_step: int) -> None:
        device = self.accelerator.device
        self.values = [torch.tensor(value, device=device) for value in values]
        self.first_step = first_step


class StepTimer:
    """Seconds per optimiser step since `restart(step)`; evaluation and checkpoints run inside `paused()`.

    It counts its own steps: after a resume the loss window holds steps trained before the restart, which the
    clock did not see."""

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


# bf16 dense tensor-core peak per GPU, from the vendors' data sheets; MFU is logged only for GPUs listed here
PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "L4": 121e12, "A10G": 70e12}


def throughput_metrics(task, config: TrainConfig, accelerator, model):
    """samples/s -> tokens/s (tasks with `tokens_per_sample`) and MFU (with `flops_per_token` and a known GPU)."""
    if not hasattr(task, "tokens_per_sample"):
        return lambda samples_per_s: {}
    tokens_per_sample = task.tokens_per_sample(config)
    peak = None
    if accelerator.device.type == "cuda" and hasattr(task, "flops_per_token"):
        name = torch.cuda.get_device_name(accelerator.device)
        peak = next((flops for gpu, flops in PEAK_FLOPS.items() if gpu in name), None)
        flops_per_token = task.flops_per_token(accelerator.unwrap_model(model), config)

    def metrics(samples_per_s: float) -> dict:
        tokens_per_s = samples_per_s * tokens_per_sample
        if peak is None:
            return {"train/tokens_per_s": tokens_per_s}
        mfu = tokens_per_s * flops_per_token / (peak * accelerator.num_processes)
        return {"train/tokens_per_s": tokens_per_s, "train/mfu": mfu}

    return metrics


class NoProfiler:
    def start(self):
        pass

    def step(self):
        pass

    def stop(self):
        pass


def step_profiler(config: TrainConfig, accelerator):
    """`--profile_steps N`: a torch.profiler trace of N steps after 2 warm-up steps, one Chrome trace per process
    in output_dir/profile/ (open it in chrome://tracing or https://ui.perfetto.dev)."""
    if not config.profile_steps:
        return NoProfiler()
    from torch.profiler import ProfilerActivity, profile, schedule

    trace_dir = Path(config.output_dir) / "profile"
    trace_dir.mkdir(parents=True, exist_ok=True)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if accelerator.device.type == "cuda" else [])

    def save(profiler) -> None:
        path = trace_dir / f"trace_rank{accelerator.process_index}.json"
        profiler.export_chrome_trace(str(path))
        logger.info("profiler trace of %d steps written to %s", config.profile_steps, path)

    return profile(
        activities=activities,
        schedule=schedule(wait=1, warmup=1, active=config.profile_steps, repeat=1),
        on_trace_ready=save,
    )
