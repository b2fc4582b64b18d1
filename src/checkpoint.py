"""The run directory, checkpoints and exact resume, preemption signals, the final model.

A checkpoint is `output_dir/checkpoints/step_<N>/`: `accelerator.save_state` (model, optimiser, LR scheduler,
every process's RNG states) plus `trainer_state.json` (step, partial loss window, batch geometry, tracker run id)
and the resolved `config.yaml`. It is written under a temporary name and renamed when complete, so a kill during
a write never leaves a "latest" that fails to load. The position in the data needs no saving: with the seedable
sampler it follows from the step (epoch = step // steps_per_epoch, then skip the batches already seen).
"""

import contextlib
import json
import logging
import os
import shutil
import signal
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from src.config import TrainConfig, save_config
from src.errors import CheckpointWriteFailed, UsageError

logger = logging.getLogger(__name__)

# What a run writes into output_dir, each name spelled once here; --overwrite_output_dir removes exactly these.
CONFIG_FILE = "config.yaml"
METRICS_FILE = "metrics.jsonl"
CHECKPOINTS_DIR = "checkpoints"
MODEL_DIR = "model"
EVAL_RESULTS_FILE = "eval_results.json"  # the final eval (and test) metrics, also of a run without training
PREDICTIONS_FILE = "predictions.jsonl"  # --do_predict: one row per sample of the predicted split, in input order
MLFLOW_STORE = "mlflow.db"  # --report_to mlflow without MLFLOW_TRACKING_URI: the run's local store (src/tracking.py)
DVCLIVE_DIR = "dvclive"
TRACKER_FILES = ("wandb", MLFLOW_STORE, DVCLIVE_DIR)  # trackers' local files (tensorboard's: output_dir/project_name)
RUN_FILES = (METRICS_FILE, CONFIG_FILE, CHECKPOINTS_DIR, MODEL_DIR, EVAL_RESULTS_FILE, PREDICTIONS_FILE)
RUN_ARTIFACTS = (*RUN_FILES, *TRACKER_FILES)
STATE_FILE = "trainer_state.json"
TMP_PREFIX = ".tmp_"


@dataclass
class TrainerState:
    """What `save_state` does not hold. `loss_window`: the losses since the last log, averaged over processes."""

    step: int = 0
    loss_window: list[float] = field(default_factory=list)
    window_first_step: int = 1
    global_batch: int = 0
    world_size: int = 1
    strategy: str | None = None  # setup/strategy of the run that saved it: "DDP", "FSDP2", "DeepSpeed ZeRO-3", ...
    tracker_run_id: str | None = None
    preempted: bool = False  # saved because of SIGTERM/SIGUSR1: scripts/slurm requeue the job on it
    best_metric: float | None = None  # early stopping
    evals_without_improvement: int = 0
    best_model_step: int | None = None  # metric_for_best_model: the step of the best evaluation so far ...
    best_model_metric: float | None = None  # ... and its value


# --- the run directory ---


def find_resume_checkpoint(config: TrainConfig) -> Path | None:
    """`--resume_from_checkpoint latest | <path>` -> a complete checkpoint, or None to start fresh."""
    if not config.resume_from_checkpoint:
        return None
    if config.resume_from_checkpoint == "latest":
        complete = complete_checkpoints(Path(config.output_dir))
        if not complete:
            logger.info("no checkpoint in %s yet: starting fresh", Path(config.output_dir) / CHECKPOINTS_DIR)
        return complete[-1] if complete else None
    path = Path(config.resume_from_checkpoint)
    if not (path / STATE_FILE).is_file():
        raise UsageError(
            f"--resume_from_checkpoint {path} is not a complete checkpoint (no {STATE_FILE}); "
            f"use a checkpoints/step_<N> folder or 'latest'"
        )
    return path


def prepare_output_dir(accelerator, config: TrainConfig, resume_step: int | None) -> Path:
    """Every process checks, then the main process writes: a refused run leaves every file as it was.

    A previous run that never finished an optimiser step (it failed while starting) holds nothing worth keeping:
    it is replaced without asking, so the same command can simply be run again.
    """
    output_dir = Path(config.output_dir)
    artifacts = [*RUN_ARTIFACTS, config.project_name]  # tensorboard logs go to output_dir/project_name
    previous = [name for name in artifacts if (output_dir / name).exists()]
    replacing = previous and resume_step is None
    asked = config.overwrite_output_dir or config.resume_from_checkpoint == "latest" or not trained_any_step(output_dir)
    if replacing and not asked:
        raise UsageError(
            f"{output_dir} already holds a run ({', '.join(previous)}); continue it with --resume_from_checkpoint "
            "latest, replace it with --overwrite_output_dir true, or choose another --output_dir"
        )
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        if replacing:  # a fresh start: nothing of the previous run's logs may mix into this one
            logger.info("replacing the previous run in %s (%s)", output_dir, ", ".join(previous))
            for name in previous:
                remove(output_dir / name)
        else:
            truncate_metrics(output_dir, resume_step or 0)
        remove_incomplete_checkpoints(output_dir)
        output_dir.mkdir(parents=True, exist_ok=True)
        save_config(config, output_dir / CONFIG_FILE)
    accelerator.wait_for_everyone()
    return output_dir


def trained_any_step(output_dir: Path) -> bool:
    """Whether a run in output_dir got past its first optimiser step: a checkpoint, a model or a logged step."""
    if (output_dir / CHECKPOINTS_DIR).is_dir() or (output_dir / MODEL_DIR).exists():
        return True
    metrics = output_dir / METRICS_FILE
    if not metrics.is_file():
        return False
    for line in metrics.read_text().splitlines():
        try:
            if json.loads(line).get("step", 0) > 0:
                return True
        except ValueError:
            return True  # not ours to judge: keep it
    return False


def remove(path: Path) -> None:
    shutil.rmtree(path) if path.is_dir() else path.unlink()


def save_final_model(accelerator, task, model, output_dir: Path) -> Path:
    """The task's format (safetensors by default), gathered from every process (FSDP/DeepSpeed shards included)."""
    model_dir = output_dir / MODEL_DIR
    task.save_model(accelerator, model, model_dir)
    accelerator.wait_for_everyone()
    return model_dir


def write_atomically(accelerator, path: Path, text: str) -> None:
    """Main process: the whole file or none of it (a kill mid-write leaves the previous one)."""
    if accelerator.is_main_process:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(TMP_PREFIX + path.name)
        partial.write_text(text)
        os.replace(partial, path)
    accelerator.wait_for_everyone()


def load_weights(model, path: str) -> None:
    """The weights in a saved model folder (model.safetensors, or shards with an index) or a checkpoint, into
    `model`; every parameter must be there with its shape (a different --model or size is one clear line)."""
    from accelerate.utils import load_checkpoint_in_model

    folder = saved_model_dir(path)
    try:
        load_checkpoint_in_model(model, str(folder), strict=True)
    except (ValueError, RuntimeError, OSError) as err:
        message = " ".join(str(err).split())[:300]
        raise UsageError(f"--model_name_or_path {path} does not hold weights for this model "
                         f"(same --task and options as when it was trained?): {message}") from err  # fmt: skip


def saved_model_dir(path: str) -> Path:
    """A run's model/ folder as given; a run's output_dir -> its model/; a checkpoint -> its exported model/ if any."""
    folder = Path(path)
    if not folder.is_dir():
        raise UsageError(f"--model_name_or_path {path}: no such folder (a run's model/ or checkpoints/step_<N>/)")
    if (folder / MODEL_DIR).is_dir() and ((folder / STATE_FILE).is_file() or (folder / CONFIG_FILE).is_file()):
        return folder / MODEL_DIR
    return folder


class BestModel:
    """`metric_for_best_model`: the best evaluation so far, its step and value kept in the trainer state (so a
    resumed run continues them). A new best is checkpointed, and rotation never removes that checkpoint."""

    def __init__(self, config: TrainConfig, state: TrainerState):
        self.metric, self.greater_is_better, self.state = config.metric_for_best_model, config.greater_is_better, state

    def improved(self, metrics: dict, step: int) -> bool:
        """Every process sees the same gathered metrics, so every process agrees without a collective."""
        if not self.metric:
            return False
        if self.metric not in metrics:
            raise UsageError(f"--metric_for_best_model {self.metric} is not logged; use one of {', '.join(metrics)}")
        value, best = metrics[self.metric], self.state.best_model_metric
        if best is not None and not (value > best if self.greater_is_better else value < best):
            return False
        self.state.best_model_step, self.state.best_model_metric = step, value
        return True

    def summary(self) -> dict:
        state = self.state
        return {"best_model/step": state.best_model_step, f"best_model/{self.metric}": state.best_model_metric}


def check_hub_push(config: TrainConfig) -> None:
    """--push_to_hub: offline or without a token, say so before training rather than after it."""
    if not config.push_to_hub:
        return
    from huggingface_hub import get_token

    from src.data import hub_offline

    if hub_offline():
        raise UsageError("--push_to_hub needs the Hugging Face Hub but HF_HUB_OFFLINE is set; unset one of them")
    if get_token() is None:
        raise UsageError("--push_to_hub needs a Hugging Face token: `hf auth login`, or set HF_TOKEN")


def push_to_hub(accelerator, config: TrainConfig, model_dir: Path) -> None:
    """Main process: create the repository if needed and upload model/ (weights, config, tokenizer)."""
    if not (config.push_to_hub and accelerator.is_main_process):
        return
    from huggingface_hub import HfApi

    repo_id = config.hub_model_id or Path(config.output_dir).resolve().name
    api = HfApi()
    api.create_repo(repo_id, exist_ok=True)
    api.upload_folder(repo_id=repo_id, folder_path=str(model_dir), commit_message="Upload model trained with train.py")
    logger.info("model pushed to https://huggingface.co/%s", repo_id)


# --- checkpoints ---


def checkpoint_step(path: Path) -> int:
    return int(path.name.removeprefix("step_"))


def checkpoint_dir(output_dir: Path, step: int) -> Path:
    return Path(output_dir) / CHECKPOINTS_DIR / f"step_{step}"


def complete_checkpoints(output_dir: Path) -> list[Path]:
    """Oldest first. Only folders with a trainer state count: the rename happens after everything is written."""
    root = output_dir / CHECKPOINTS_DIR
    found = [p for p in root.glob("step_*") if (p / STATE_FILE).is_file()] if root.is_dir() else []
    return sorted(found, key=checkpoint_step)


def remove_incomplete_checkpoints(output_dir: Path) -> None:
    for path in sorted((output_dir / CHECKPOINTS_DIR).glob(f"{TMP_PREFIX}*")):
        logger.warning("removing %s: an incomplete checkpoint from an interrupted write", path)
        shutil.rmtree(path, ignore_errors=True)


def save_checkpoint(accelerator, config: TrainConfig, state: TrainerState, export=None) -> Path:
    """All processes call this (DeepSpeed and FSDP save shards from every rank); it returns once the rename is done.
    `export(directory)`, if given, also writes the model in the task's own format into the checkpoint's model/.

    A failed write (disk full, quota) on any process is agreed on by all, the partial folder is removed, and the
    run stops with an error: the previous checkpoints were never touched.
    """
    final = checkpoint_dir(config.output_dir, state.step)
    root = final.parent
    partial = root / f"{TMP_PREFIX}step_{state.step}"
    if accelerator.is_main_process:
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
    accelerator.wait_for_everyone()
    failure = None
    try:
        accelerator.save_state(str(partial))
        if export is not None:
            export(partial / MODEL_DIR)
        if accelerator.is_main_process:
            (partial / STATE_FILE).write_text(json.dumps(asdict(state), indent=2))
            save_config(config, partial / CONFIG_FILE)
    except OSError as err:
        failure = err
    if not all_processes_agree(accelerator, failure is None):
        if accelerator.is_main_process:
            shutil.rmtree(partial, ignore_errors=True)
        reason = f"{type(failure).__name__}: {failure}" if failure else "failed on another process"
        raise CheckpointWriteFailed(
            f"could not write checkpoint {final} ({reason}); the previous checkpoints are intact. "
            "Free disk space (or lower --save_total_limit) and resume with --resume_from_checkpoint latest"
        )
    if accelerator.is_main_process:
        if final.exists():  # re-saving a step (e.g. a resumed run that stops where it started)
            shutil.rmtree(final)
        os.replace(partial, final)  # atomic on one file system: the checkpoint appears whole or not at all
        rotate_checkpoints(root.parent, config.save_total_limit, keep_step=state.best_model_step)
    accelerator.wait_for_everyone()
    return final


def all_processes_agree(accelerator, ok: bool) -> bool:
    if accelerator.num_processes == 1:
        return ok
    flag = torch.tensor(float(ok), device=accelerator.device)
    return bool(accelerator.reduce(flag, reduction="sum").item() == accelerator.num_processes)


def rotate_checkpoints(output_dir: Path, keep: int | None, keep_step: int | None = None) -> None:
    """The newest `keep` checkpoints stay, and the best model's (`keep_step`) whatever its age."""
    if keep:
        for old in complete_checkpoints(output_dir)[:-keep]:
            if checkpoint_step(old) != keep_step:
                shutil.rmtree(old)


def load_checkpoint(accelerator, path: Path, expected: TrainerState) -> TrainerState:
    """Restore model, optimiser, scheduler and RNG states on every process; refuse an incompatible checkpoint.
    `expected`: this run's global batch, process count and strategy."""
    try:
        state = TrainerState(**json.loads((path / STATE_FILE).read_text()))
    except (ValueError, TypeError) as err:
        raise UsageError(f"checkpoint {path} is corrupt ({STATE_FILE}: {err}); resume from another one") from err
    if state.global_batch != expected.global_batch:
        raise UsageError(
            f"checkpoint {path} was trained with a global batch of {state.global_batch}, this run has "
            f"{expected.global_batch}; set --global_batch_size {state.global_batch} to resume it"
        )
    check_same_sharding(path, state, expected)
    try:
        accelerator.load_state(str(path))
    except Exception as err:  # torch, safetensors and pickle each raise their own kinds for a bad file
        message = " ".join(str(err).split())[:300]
        raise UsageError(f"checkpoint {path} does not fit this model/optimiser or is damaged: {message}") from err
    return replace(state, world_size=expected.world_size, strategy=expected.strategy)  # this run's, from now


UNSHARDED = ("single process", "DDP")  # checkpoints of a whole model: they load on any process count


def check_same_sharding(path: Path, saved: TrainerState, expected: TrainerState) -> None:
    """A sharded checkpoint (FSDP2's DCP shards, DeepSpeed's ZeRO partitions) holds one file set per process of the
    strategy that wrote it: it resumes under that strategy on that many processes."""
    if saved.strategy is None or (saved.strategy in UNSHARDED and expected.strategy in UNSHARDED):
        return  # whole-model checkpoints (or one written before strategies were recorded)
    if (saved.strategy, saved.world_size) != (expected.strategy, expected.world_size):
        raise UsageError(
            f"checkpoint {path} was saved by {saved.strategy} on {saved.world_size} processes and this run is "
            f"{expected.strategy} on {expected.world_size}; resume it with the accelerate config it was trained "
            f"with and --num_processes {saved.world_size}"
        )


def truncate_metrics(output_dir: Path, step: int) -> None:
    """A resumed run re-logs the steps after its checkpoint: drop them so metrics.jsonl has each step once."""
    path = output_dir / METRICS_FILE
    if path.exists():
        lines = path.read_text().splitlines(keepends=True)
        path.write_text("".join(line for line in lines if json.loads(line)["step"] <= step))


# --- preemption ---


class PreemptionSignals:
    """SIGTERM / SIGUSR1 (SLURM's warning before the time limit) ask for a checkpoint at a step boundary.

    Processes may receive the signal at different steps, so they must agree on when to save. Every `every`-th step
    starts an all-reduce of the flag, in the background on a CPU (gloo) group, and reads the one started `every`
    steps earlier: every process sees the same sum at the same step and no step waits for the network or the GPU.
    On GPUs that is every step (the checkpoint comes one step after the signal). When the processes train on the CPU,
    gloo's background work takes cores from training (5-10% of a 2-process step on 2 cores, measured with
    scripts/benchmark.py), so they agree every 10 steps. One process needs no agreement and no collective.
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
