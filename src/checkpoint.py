"""Checkpoints (`checkpoints/step_<N>/`: `save_state`, trainer state, config), exact resume (data: src/batches.py)."""

import json
import logging
import shutil
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from src.config import TrainConfig, save_config
from src.errors import CheckpointWriteFailed, UsageError, one_line
from src.run_dir import (
    CHECKPOINTS_DIR,
    CONFIG_FILE,
    MODEL_DIR,
    STATE_FILE,
    TMP_PREFIX,
    continues_its_run,
    move_into_place,
)

logger = logging.getLogger(__name__)


@dataclass
class TrainerState:
    """What `accelerator.save_state` does not hold."""

    step: int = 0
    loss_window: list[float] = field(default_factory=list)  # the losses since the last log, averaged over processes
    window_first_step: int = 1
    global_batch: int = 0
    world_size: int = 1
    strategy: str | None = None  # setup/strategy of the run that saved it: "DDP", "FSDP2", "DeepSpeed ZeRO-3", ...
    tracker_run_id: str | None = None
    preempted: bool = False  # saved because of SIGTERM/SIGUSR1: scripts/slurm requeue the job on it
    skipped_steps: int = 0  # --skip_nonfinite_batches: the optimiser steps skipped so far
    best_metric: float | None = None  # early stopping
    evals_without_improvement: int = 0
    early_stopping_by: str | None = None  # its metric and mode, e.g. "eval/loss min": another resets the count
    best_model_step: int | None = None  # metric_for_best_model: the step of the best evaluation so far ...
    best_model_metric: float | None = None  # ... and its value
    best_model_by: str | None = None  # its metric and direction, e.g. "eval/loss min": another resets the best


def resume(accelerator, config: TrainConfig, fresh: TrainerState) -> tuple[TrainerState, bool]:
    """`--resume_from_checkpoint latest | <path>`: (its state, True) once loaded everywhere, or (`fresh`, False).
    Refused: another global batch, or a strategy that can't read it. A whole model (1 process, DDP), and FSDP2 shards
    under FSDP2, resume on any process count; ZeRO partitions only under their stage and process count."""
    if not config.resume_from_checkpoint:
        return fresh, False
    path = Path(config.resume_from_checkpoint)
    if config.resume_from_checkpoint == "latest":
        if not (complete := complete_checkpoints(Path(config.output_dir))):
            logger.info("no checkpoint in %s yet: starting fresh", Path(config.output_dir) / CHECKPOINTS_DIR)
            return fresh, False
        path = complete[-1]
    elif not path.exists():
        there = complete_checkpoints(path.parent.parent) if path.parent.name == CHECKPOINTS_DIR else []
        raise UsageError(
            f"--resume_from_checkpoint {path} does not exist"
            + (f" ({path.parent} has {', '.join(p.name for p in there)})" if there else "")
            + "; name a checkpoints/step_<N> folder, or 'latest'"
        )
    elif not (path / STATE_FILE).is_file():
        raise UsageError(
            f"--resume_from_checkpoint {path} is not a complete checkpoint (no {STATE_FILE}); "
            f"use a checkpoints/step_<N> folder or 'latest'"
        )
    try:
        state = TrainerState(**json.loads((path / STATE_FILE).read_text()))
    except (ValueError, TypeError) as err:
        raise UsageError(f"checkpoint {path} is corrupt ({STATE_FILE}: {err}); resume from another one") from err
    if state.global_batch != fresh.global_batch:
        raise UsageError(
            f"checkpoint {path} was trained with a global batch of {state.global_batch}, this run has "
            f"{fresh.global_batch}; set --global_batch_size {state.global_batch} to resume it"
        )
    check_sharding(path, state, fresh)
    own = continues_its_run(config)  # else a new run here from its weights: one that --overwrite_output_dir replaces
    there = [] if config.overwrite_output_dir and not own else complete_checkpoints(Path(config.output_dir))
    if later := [p.name for p in there if checkpoint_step(p) > state.step]:
        raise UsageError(
            f"--resume_from_checkpoint {path} goes on from step {state.step}, but {config.output_dir} holds later "
            f"checkpoints ({', '.join(later)}) that `latest` would take for this run's; delete them to go on from "
            f"step {state.step} there, or choose another --output_dir"
        )
    try:
        accelerator.load_state(str(path))
    except Exception as err:  # torch, safetensors and pickle each raise their own kinds for a bad file
        message = one_line(err)[:300]
        raise UsageError(
            f"checkpoint {path} does not fit this model/optimiser or is damaged (resume with the task options it was "
            f"trained with: its {CONFIG_FILE}): {message}"
        ) from err
    # 0: a checkpoint ends a window, and the micro-batch count Accelerate restores is wrong on another process count
    accelerator.step = 0
    logger.info("resuming from %s at step %d", path, state.step)
    state = replace(state, world_size=fresh.world_size, strategy=fresh.strategy)  # this run's, from now
    if not own:  # another folder's checkpoint: a new run here from its weights, with trackers of its own
        state.tracker_run_id = None
    best = state.best_model_step
    if best is not None and not (own and (checkpoint_dir(config.output_dir, best) / STATE_FILE).is_file()):
        logger.warning("the best model so far (step %d) has no checkpoint in %s to load at the end: the best is "
                       "chosen again from the next evaluation on", best, config.output_dir)  # fmt: skip
        state.best_model_step = state.best_model_metric = None
    return state, True


# what scripts/convert_checkpoint.py --to <key> converts from: the sharded into a whole model, a whole one into FSDP2
CONVERTS = {"DDP": ("FSDP2", "DeepSpeed ZeRO-2", "DeepSpeed ZeRO-3"), "FSDP2": ("DDP", "single process")}


def check_sharding(path: Path, saved: TrainerState, fresh: TrainerState) -> None:
    """Refuse a checkpoint this run's strategy can't read (`resume`), naming a conversion (`CONVERTS`) if one exists."""
    resharded, pair, whole = saved.strategy == "FSDP2", {saved.strategy, fresh.strategy}, {"single process", "DDP"}
    same_sharding = saved.strategy == fresh.strategy and (resharded or saved.world_size == fresh.world_size)
    unknown = saved.strategy is None or (saved.strategy == "single process" and saved.world_size > 1)  # 0.6.0's
    if same_sharding or pair <= whole or unknown:  # not recorded, or a compiled run's recorded wrongly before 0.7.0
        return
    where = "on any number of processes" if resharded else f"and --num_processes {saved.world_size}"
    to = "DDP" if fresh.strategy in whole else fresh.strategy
    if saved.strategy in CONVERTS.get(to, ()):
        where += f", or convert it: python scripts/convert_checkpoint.py {path} NEW_FOLDER --to {to}"
    raise UsageError(
        f"checkpoint {path} was saved by {saved.strategy} on {saved.world_size} processes and this run is "
        f"{fresh.strategy} on {fresh.world_size}; resume it with the accelerate config it was trained with {where}"
    )


def checkpoint_step(path: Path) -> int:
    return int(path.name.removeprefix("step_"))


def checkpoint_dir(output_dir: Path, step: int) -> Path:
    return Path(output_dir) / CHECKPOINTS_DIR / f"step_{step}"


def complete_checkpoints(output_dir: Path) -> list[Path]:
    """Oldest first. Only folders with a trainer state count: the rename happens after everything is written."""
    found = [p for p in (output_dir / CHECKPOINTS_DIR).glob("step_*") if (p / STATE_FILE).is_file()]
    numbered = [p for p in found if p.name.removeprefix("step_").isdigit()]  # not a copy named step_8.bak
    return sorted(numbered, key=checkpoint_step)


def save_checkpoint(accelerator, config: TrainConfig, state: TrainerState, export=None) -> Path:
    """Every process calls it (sharded strategies save from each); returns once `step_<N>/` is renamed into place.
    `export(dir)` also writes the task's model/; a failed write on any process stops all, older checkpoints intact."""
    final = checkpoint_dir(config.output_dir, state.step)
    partial = final.with_name(TMP_PREFIX + final.name)
    failure = None
    if accelerator.is_main_process:
        try:
            shutil.rmtree(partial, ignore_errors=True)
            partial.mkdir(parents=True)
        except OSError as err:  # e.g. checkpoints/ no longer writable
            failure = err
    if all_processes_agree(accelerator, failure is None):  # (a collective: the folder exists for every process)
        try:
            accelerator.save_state(str(partial))
            if export is not None:
                export(partial / MODEL_DIR)
            if accelerator.is_main_process:
                (partial / STATE_FILE).write_text(json.dumps(asdict(state), indent=2))
                save_config(config, partial / CONFIG_FILE)
        except Exception as err:  # a full disk is OSError from Python, RuntimeError from torch.save, safetensors' own
            failure = err
    if not all_processes_agree(accelerator, failure is None):
        if accelerator.is_main_process:
            shutil.rmtree(partial, ignore_errors=True)
        raise write_failed(failure, f"checkpoint {final}", "the previous checkpoints are intact. Free disk space (or "
                           "lower --save_total_limit) and resume with --resume_from_checkpoint latest")  # fmt: skip
    if accelerator.is_main_process:
        move_into_place(partial, final)  # whole or not at all; a step saved again replaces its previous save
        rotate_checkpoints(Path(config.output_dir), config.save_total_limit, keep_step=state.best_model_step)
    accelerator.wait_for_everyone()
    return final


def write_failed(failure: Exception | None, what: str, advice: str) -> CheckpointWriteFailed:
    """The error that stops every process when a write failed on one (`failure` None: on another, which says why)."""
    reason = f"{type(failure).__name__}: {one_line(failure)[:300]}" if failure else "failed on another process"
    stopped = CheckpointWriteFailed(f"could not write {what} ({reason}); {advice}")
    stopped.said_elsewhere = failure is None
    return stopped


def all_processes_agree(accelerator, ok: bool) -> bool:
    if accelerator.num_processes == 1:
        return ok
    flag = torch.tensor(float(ok), device=accelerator.device)
    return bool(accelerator.reduce(flag, reduction="sum").item() == accelerator.num_processes)


def rotate_checkpoints(output_dir: Path, keep: int | None, keep_step: int | None = None) -> None:
    if keep:
        for old in complete_checkpoints(output_dir)[:-keep]:
            if checkpoint_step(old) != keep_step:
                shutil.rmtree(old)
