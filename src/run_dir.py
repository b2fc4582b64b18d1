"""The run directory (`output_dir`): the names of what a run writes there, and getting it ready without losing a run."""

import contextlib
import errno
import fcntl
import json
import logging
import os
import shutil
import socket
from pathlib import Path

from src.config import TrainConfig, save_config
from src.errors import UsageError, is_main_process

logger = logging.getLogger(__name__)

# What a run writes into output_dir, each name spelled once here; a fresh run that replaces one removes these (but
# an MLflow store this process logs to: prepare_output_dir).
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
STATE_FILE = "trainer_state.json"
TMP_PREFIX = ".tmp_"


LOCK_FILE = ".lock"  # locked by the main process of the run training in output_dir (a POSIX lock: its own alone)
_held: dict[Path, int] = {}  # folder -> the descriptor of its LOCK_FILE, locked by this process


@contextlib.contextmanager
def one_run_at_a_time(config: TrainConfig):
    """Training holds output_dir until it returns: another run there (the same command twice, a requeued job beside
    its first) is refused. The system frees a killed run's lock at once on a local disk (a POSIX lock is the
    process's: its forked data-loader workers, still exiting, hold none); see claim for network file systems."""
    held_before = set(_held)
    claim(Path(config.output_dir))
    try:
        yield
    finally:
        for folder in set(_held) - held_before:
            descriptor = _held.pop(folder)
            with contextlib.suppress(OSError):  # never in place of the run's own exit (a preemption's 75)
                os.close(descriptor)  # which frees its lock: a POSIX lock is freed at any close of its file


def claim(output_dir: Path, make: bool = False) -> None:
    """The main process locks output_dir's LOCK_FILE if a run made one there, or makes it (`make`: prepare_output_dir,
    before it changes anything): a refused run writes nothing. It writes its pid and host there: a lock that outlived
    a crashed node (a network file system's lease) is named, to be deleted."""
    folder = output_dir.resolve()
    if not is_main_process() or folder in _held or not (make or (folder / LOCK_FILE).is_file()):
        return
    try:
        descriptor = os.open(folder / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:  # e.g. another user's run made it: unguarded
        return
    try:
        fcntl.lockf(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as err:
        holder = os.read(descriptor, 200).decode(errors="replace").strip() or "its lock's holder unknown"
        os.close(descriptor)
        if err.errno in (errno.EACCES, errno.EAGAIN):
            raise UsageError(
                f"another run is training in {output_dir} ({holder}); wait for it to end, or choose another "
                f"--output_dir (where none is, the lock of a crashed node on a network file system: delete "
                f"{output_dir / LOCK_FILE})"
            ) from None
        return  # a file system without locks: unguarded
    os.ftruncate(descriptor, 0)
    os.write(descriptor, f"pid {os.getpid()} on {socket.gethostname()}\n".encode())
    _held[folder] = descriptor


def refuse_to_replace(config: TrainConfig, resuming: bool) -> list[str]:
    """The run files in output_dir; a fresh run that would replace a run that trained, unasked, is refused. Called
    before the data is read too (train.py), so that a refusal does not wait for it. `resuming`: a checkpoint is loaded
    (before the data is read: may be); one of another folder's starts this folder's run afresh."""
    output_dir = Path(config.output_dir)
    check_writable(output_dir)
    previous = run_files(output_dir, config.project_name)
    if not previous or (resuming and continues_its_run(config)) or config.overwrite_output_dir:
        return previous
    if not trained_any_step(output_dir):
        return previous  # a run stopped before its first step: nothing worth keeping
    if config.resume_from_checkpoint != "latest":
        raise UsageError(
            f"{output_dir} already holds a run ({', '.join(previous)}); continue it with --resume_from_checkpoint "
            "latest, replace it with --overwrite_output_dir true, or choose another --output_dir"
        )
    if (output_dir / MODEL_DIR).exists():  # `latest` found no checkpoint: model/ is the finished run's only copy
        raise UsageError(
            f"{output_dir} holds a finished run ({', '.join(previous)}) but no checkpoint to continue it from: "
            "--resume_from_checkpoint latest would start afresh and replace its model/; replace it with "
            "--overwrite_output_dir true, or choose another --output_dir"
        )
    return previous  # stopped before its first checkpoint: `latest` starts it afresh, as the same command asks


def run_files(output_dir: Path, project_name: str) -> list[str]:
    """What a run of this template left in output_dir: its RUN_FILES and, beside them, its trackers' local files
    (tensorboard's: the project_name folder of event files). Without a run file, nothing there is a run's."""
    ours = [name for name in RUN_FILES if (output_dir / name).exists()]
    if not ours:
        return []
    trackers = [name for name in TRACKER_FILES if (output_dir / name).exists()]
    tensorboard = any((output_dir / project_name).glob("events.out.tfevents.*"))
    return [*ours, *trackers, *([project_name] if tensorboard else [])]


def continues_its_run(config: TrainConfig) -> bool:
    """Whether --resume_from_checkpoint continues output_dir's own run: `latest`, or a checkpoint inside output_dir
    (one of another folder's starts a new run there from its weights)."""
    checkpoint = config.resume_from_checkpoint
    output_dir = Path(config.output_dir).resolve()
    return checkpoint == "latest" or (checkpoint is not None and Path(checkpoint).resolve().is_relative_to(output_dir))


def check_writable(output_dir: Path) -> None:
    """--output_dir is a folder this process may write in, or may make: one line now, not a traceback at a write."""
    existing = next(path for path in (output_dir, *output_dir.parents) if path.exists())  # at worst . or /
    if not existing.is_dir():
        raise UsageError(f"--output_dir {output_dir}: {existing} is a file, not a folder; choose another --output_dir")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UsageError(
            f"--output_dir {output_dir}: {existing} is not writable; choose another --output_dir or make it writable"
        )


def prepare_output_dir(accelerator, config: TrainConfig, resume_step: int | None) -> Path:
    """Every process checks, then the main process writes: a refused run leaves every file as it was. A previous run
    that never finished an optimiser step holds nothing worth keeping: it is replaced, so the same command reruns."""
    output_dir = Path(config.output_dir)
    continuing = resume_step is not None and continues_its_run(config)  # another folder's checkpoint: afresh here
    previous = refuse_to_replace(config, resuming=continuing)
    replacing = previous and not continuing
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        output_dir.mkdir(parents=True, exist_ok=True)
        claim(output_dir, make=True)  # held from now, before anything in it changes
        if replacing:  # a fresh start: nothing of the previous run's logs may mix into this one
            # but a store this process's MLflow logged to (a notebook's earlier run, a retry): it keeps a connection
            # by URI for good and can't write to a store made anew, so that store stays (a run of its own there)
            in_use = mlflow_store_uri(output_dir) in mlflow_stores_opened
            replaced = [name for name in previous if not (name == MLFLOW_STORE and in_use)]
            logger.info("replacing the previous run in %s (%s)", output_dir, ", ".join(replaced))
            for path in (output_dir / name for name in replaced):
                remove(path)
        elif (metrics := output_dir / METRICS_FILE).exists():  # a resumed run logs the steps after its checkpoint again
            steps = [(line, logged_step(line)) for line in metrics.read_text().splitlines(keepends=True)]
            if cut := sum(step is None for _, step in steps):
                logger.warning("dropping %d line(s) of %s that a kill or full disk cut short", cut, metrics)
            kept = [line for line, step in steps if step is not None and step <= (resume_step or 0)]
            partial = metrics.with_name(TMP_PREFIX + metrics.name)  # the log whole or as it was, even if killed here
            partial.write_text("".join(kept))
            os.replace(partial, metrics)
        aside, model = output_dir / f"{TMP_PREFIX}previous_{MODEL_DIR}", output_dir / MODEL_DIR
        if aside.is_dir() and not model.exists() and not replacing:  # killed between move_into_place's two renames
            logger.warning("restoring %s: a stopped run had renamed it aside to save a new one", model)
            os.replace(aside, model)
        leftovers = [*output_dir.glob(f"{TMP_PREFIX}*"), *(output_dir / CHECKPOINTS_DIR).glob(f"{TMP_PREFIX}*")]
        for path in sorted(leftovers):
            logger.warning("removing %s: an incomplete checkpoint, model or upload snapshot of a stopped run", path)
            remove(path)
        save_config(config, output_dir / CONFIG_FILE)
    accelerator.wait_for_everyone()
    return output_dir


def mlflow_store_uri(output_dir: Path) -> str:
    """--report_to mlflow without MLFLOW_TRACKING_URI: the run's local store, output_dir/mlflow.db (src/tracking.py)."""
    return f"sqlite:///{output_dir.resolve() / MLFLOW_STORE}"


mlflow_stores_opened: set[str] = set()  # the local stores this process's MLflow has logged to (src/tracking.py)


def logged_step(line: str) -> int | None:
    """The step of a metrics.jsonl line; None for a line cut short (or not one of ours)."""
    try:
        return json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):
        return None


def trained_any_step(output_dir: Path) -> bool:
    """Whether a run in output_dir got past its first optimiser step: a checkpoint, a model or a logged step."""
    if (output_dir / CHECKPOINTS_DIR).is_dir() or (output_dir / MODEL_DIR).exists():
        return True
    path = output_dir / METRICS_FILE
    steps = [logged_step(line) for line in path.read_text().splitlines()] if path.is_file() else []
    return any(step is None or step > 0 for step in steps)  # None: a line not ours to judge, so the run is kept


def remove(path: Path) -> None:
    shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)


def move_into_place(partial: Path, final: Path) -> None:
    """`partial` (a folder) renamed to `final`, an existing `final` renamed aside first and then removed: there is a
    whole one at every moment, never one half removed (a kill during a large model's rmtree)."""
    previous = final.with_name(f"{TMP_PREFIX}previous_{final.name}")
    shutil.rmtree(previous, ignore_errors=True)
    if final.exists():
        os.replace(final, previous)
    os.replace(partial, final)  # atomic on one file system
    shutil.rmtree(previous, ignore_errors=True)


def write_atomically(accelerator, path: Path, text: str) -> None:
    """Main process: the whole file or none of it (a kill mid-write leaves the previous one)."""
    if accelerator.is_main_process:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(TMP_PREFIX + path.name)
        partial.write_text(text)
        os.replace(partial, path)
    accelerator.wait_for_everyone()
