"""What the main process alone writes (console, metrics.jsonl, trackers, progress bar): the loop never asks its rank."""

import contextlib
import json
import logging
import netrc
import os
import shutil
import sys
import warnings
from pathlib import Path

import accelerate
import torch
from accelerate.tracking import GeneralTracker
from tqdm.auto import tqdm

from src.config import TrainConfig
from src.errors import TrainingPreempted, UsageError, one_line
from src.run_dir import DVCLIVE_DIR, METRICS_FILE, mlflow_store_uri, mlflow_stores_opened
from src.strategy import fsdp_units, strategy_of

logger = logging.getLogger(__name__)


def setup_logging(accelerator) -> None:
    """INFO lines from the main process; other processes print errors only (no N copies of every warning)."""
    level = logging.INFO if accelerator.is_main_process else logging.ERROR
    logging.basicConfig(format="%(asctime)s %(message)s", datefmt="%H:%M:%S", level=level, force=True)
    logging.getLogger("accelerate").setLevel(logging.WARNING)  # its INFO lines repeat ours, some wrongly
    logging.getLogger("accelerate.tracking").setLevel(logging.ERROR)  # "dropped a string" for setup/device etc.
    # The one place filtering warnings (bar quiet_peft's): each once on the main (libraries reset once-per-line memory)
    if not accelerator.is_main_process:
        warnings.filterwarnings("ignore")
        logging.getLogger("torch").setLevel(logging.ERROR)  # torch's own handlers (torch._logging): not the root's
        return
    for category in (FutureWarning, UserWarning):
        warnings.filterwarnings("once", category=category)
    deprecated = r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated"
    warnings.filterwarnings("ignore", message=deprecated, category=FutureWarning)  # DeepSpeed ZeRO's, at every step


class JsonlTracker(GeneralTracker):
    """An Accelerate tracker: one JSON object per `accelerator.log` call, appended to `output_dir/metrics.jsonl`."""

    name = "jsonl"
    requires_logging_directory = False
    tracker = None  # the open file, once started

    def __init__(self, path: Path):
        super().__init__()
        self.path = Path(path)

    def start(self):  # called by init_trackers on the main process only (GeneralTracker.main_process_only)
        self.tracker = open(self.path, "a", buffering=1)  # noqa: SIM115 (closed in finish, or at exit); line-buffered: a kill keeps every line

    def log(self, values: dict, step: int | None = None, **kwargs):
        self.tracker.write(json.dumps({"step": step, **values}) + "\n")

    def finish(self):
        self.tracker.close()


started: list = []  # the trackers of this process's run until it ends: one that raised leaves them unfinished


@contextlib.contextmanager
def finished_on_error():
    """Trackers a run started are finished if it raises, as `accelerator.end_training` finishes them when it ends
    (a notebook's next run would find its MLflow run still active: MLflow refuses a second), marked as stopped."""
    try:
        yield
    except BaseException as error:
        finish_started(error)
        raise


def finish_started(error: BaseException | None = None) -> None:
    """Finish the trackers `started` holds; after `error`, MLflow's run as KILLED (preempted, Ctrl-C) or FAILED and
    wandb's with exit code 1."""
    stopped = isinstance(error, (TrainingPreempted, KeyboardInterrupt))
    while started:
        tracker = started.pop()
        with contextlib.suppress(Exception):  # one failing to finish keeps no other open
            if error is not None and tracker.name == "mlflow":
                import mlflow

                mlflow.end_run(status="KILLED" if stopped else "FAILED")
            elif error is not None and tracker.name == "wandb":
                tracker.run.finish(exit_code=1)
            else:
                tracker.finish()


def build_trackers(config: TrainConfig) -> list:
    finish_started()  # what a try before this one left (--auto_find_batch_size's), before its folder is replaced
    return [JsonlTracker(Path(config.output_dir) / METRICS_FILE), *config.report_to]


def start_tracking(accelerator, config: TrainConfig, resume_run_id: str | None = None) -> str | None:
    """Start one tracker run (main process); a resumed run continues its wandb run. Returns the wandb run id."""
    wandb_kwargs = dict(name=config.run_name, dir=config.output_dir, tags=config.run_tags, group=config.run_group)
    if "wandb" in config.report_to:
        configure_wandb(config)
        if resume_run_id:
            wandb_kwargs |= {"id": resume_run_id, "resume": "allow"}
    if "mlflow" in config.report_to and accelerator.is_main_process and not os.environ.get("MLFLOW_TRACKING_URI"):
        import mlflow  # a local store in output_dir (SQLite: MLflow 3 refuses a new ./mlruns file store)

        uri = mlflow_store_uri(Path(config.output_dir))
        mlflow_stores_opened.add(uri)
        mlflow.set_tracking_uri(uri)
        logger.info("mlflow: logging to %s; browse with `mlflow ui --backend-store-uri %s`", uri, uri)
    mlflow_tags = {tag: "true" for tag in config.run_tags} | ({"group": config.run_group} if config.run_group else {})
    init_kwargs = {
        "wandb": wandb_kwargs,
        "mlflow": {"run_name": config.run_name, "tags": mlflow_tags},
        "dvclive": {"dir": str(Path(config.output_dir) / DVCLIVE_DIR)},  # not ./dvclive in the working directory
    }
    scalars = {k: v if isinstance(v, int | float | str | bool | None) else str(v) for k, v in config.to_dict().items()}
    try:
        accelerator.init_trackers(config.project_name, config=scalars, init_kwargs=init_kwargs)  # tensorboard: scalars
    except Exception as err:  # a tracker refusing its settings: wandb's tags, a WANDB_MODE it doesn't know, ...
        trackers = ", ".join(config.report_to) or "jsonl"
        raise UsageError(f"--report_to {trackers}: a tracker could not start ({type(err).__name__}: "
                         f"{one_line(err)[:300]}); check its settings (--run_name, --run_tags, --run_group, "
                         "--project_name) and its environment variables") from err  # fmt: skip
    finally:
        started[:] = accelerator.trackers  # those started before one that failed, too
    if "wandb" in config.report_to and accelerator.is_main_process:
        return accelerator.get_tracker("wandb", unwrap=True).id
    return resume_run_id


def configure_wandb(config: TrainConfig) -> None:
    """Without WANDB_MODE or keys (WANDB_API_KEY, a netrc entry from `wandb login`): offline, not a prompt forever."""
    if os.environ.get("WANDB_MODE") or os.environ.get("WANDB_API_KEY"):
        return
    with contextlib.suppress(FileNotFoundError, netrc.NetrcParseError):
        if netrc.netrc(os.environ.get("NETRC")).authenticators("api.wandb.ai"):
            return
    os.environ["WANDB_MODE"] = "offline"
    logger.info(
        "wandb: no API key found, logging offline; upload later with `wandb sync %s/wandb/offline-run-*`",
        config.output_dir,
    )


def setup_metrics(accelerator, model, config: TrainConfig, global_batch: int) -> dict:
    strategy = strategy_of(model)
    return {
        "setup/parameters": parameter_count(model),
        "setup/trainable_parameters": parameter_count(model, trainable_only=True),  # fewer with --peft lora
        "setup/strategy": strategy,
        **({"setup/fsdp_units": fsdp_units(model)} if strategy == "FSDP2" else {}),
        "setup/world_size": accelerator.num_processes,
        "setup/per_device_batch": config.per_device_train_batch_size,
        "setup/global_batch": global_batch,
        "setup/gradient_accumulation": accelerator.gradient_accumulation_steps,
        "setup/mixed_precision": accelerator.mixed_precision,
        "setup/device": str(accelerator.device),
        "setup/torch": torch.__version__,
        "setup/accelerate": accelerate.__version__,
    }


def parameter_count(model, trainable_only: bool = False) -> int:
    """Every parameter's elements, whole under FSDP2 (a DTensor's numel) and ZeRO-3 (ds_numel)."""
    return sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters() if p.requires_grad or not trainable_only)


def log_metrics(accelerator, metrics: dict, step: int) -> None:
    """`metrics` (numbers; a one-value tensor or numpy number is read as one) to the trackers and the console."""
    metrics = {key: value.item() if hasattr(value, "item") else value for key, value in metrics.items()}
    accelerator.log(metrics, step=step)
    line = " | ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in metrics.items())
    logger.info("step %d | %s", step, line)


def progress_bar(accelerator, total: int, initial: int = 0):
    """tqdm on the main process when stdout is a terminal; otherwise the periodic log lines are the progress."""
    size = shutil.get_terminal_size()  # 80x24 where a pseudo-terminal reports 0x0 (tqdm would then draw nothing)
    shown = accelerator.is_main_process and sys.stdout.isatty()
    return tqdm(total=total, initial=initial, unit="step", ncols=size.columns, nrows=size.lines, disable=not shown)
