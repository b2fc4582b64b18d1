"""Train a model with Hugging Face Accelerate: the same file on a laptop CPU, one GPU, N GPUs or a cluster.

    python train.py                                          # one process
    accelerate launch --config_file accelerate_configs/ddp.yaml train.py --config configs/default.yaml
    python train.py --do_train false --do_predict true       # evaluate runs/digits/model, write predictions.jsonl

config -> accelerator -> task (src/tasks/) -> train loop -> save; the rest is in src/ (docs/how_it_works.md), features
reach the loop via `features.installed()`. Nothing here asks which process it runs on. Edit the loop freely:
docs/customize.md says what must stay for 1 and N processes to train the same.
"""

import gc
import json
import logging
import math
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.utils import set_seed
from torch import nn
from torch.utils.data import DataLoader

from src import (
    batches,
    checkpoint,
    distributed,
    errors,
    features,
    final_model,
    loaders,
    meters,
    optim,
    preemption,
    run_dir,
    strategy,
    tasks,
    tracking,
)
from src.best import BestEvaluation
from src.cli import parse_config
from src.config import TrainConfig
from src.metrics import Metric, load_metrics

logger = logging.getLogger("train")


def main(args: list[str] | TrainConfig | None = None) -> dict:
    """Train and evaluate; returns the final eval metrics. `args`: CLI flags, a TrainConfig, or None (sys.argv)."""
    config = parse_config(args)
    with tasks.task_errors(tasks.task_class(config.task)):  # the task's code failing, wherever: one line naming it
        if not config.do_train:
            return evaluate_and_predict(config)
        # a job preempted as it sets up checkpoints at its first step; one run at a time in output_dir; trackers
        # finished however it ends
        with preemption.noted_from_the_start(), run_dir.one_run_at_a_time(config), tracking.finished_on_error():
            return features.installed().wrap_train(train)(config)  # e.g. retried with a smaller batch: auto_batch_size


@dataclass
class Setup:
    """What training and evaluation share: the task and its metric, the prepared model and loaders."""

    accelerator: Accelerator
    task: tasks.Task
    model: nn.Module  # prepared, and compiled with --torch_compile: what trains and evaluates
    saved_model: nn.Module  # the prepared model without compilation: what checkpoints export and model/ saves
    metric: Metric | None  # None: the loss only
    train_loader: DataLoader | None  # training only
    eval_loader: DataLoader | None
    test_loader: DataLoader | None  # the labelled test split, where the data has one
    predict_loader: DataLoader | None  # --do_predict: the task's prediction inputs of `predict_split`
    predict_split: str | None
    optimizer: AcceleratedOptimizer | None  # prepared: training (and eval-only under FSDP2 or ZeRO-1/2, never stepped)


def set_up(config: TrainConfig, training: bool) -> Setup:
    """config -> accelerator -> task (data, model, metric) -> `accelerator.prepare`; nothing is written yet."""
    accelerator = distributed.build_accelerator(config, log_with=tracking.build_trackers(config) if training else None)
    tracking.setup_logging(accelerator)
    set_seed(config.seed)  # same seed on every process: identical initial weights, like a broadcast
    task = tasks.build_task(config)
    pin_memory = accelerator.device.type == "cuda"
    train_loader, eval_loader = loaders.build_loaders(task, config, accelerator, training, pin_memory)
    test_loader, predict_split, predict_loader = loaders.build_test_and_predict_loaders(task, config, pin_memory)
    model = tasks.starting_model(task, config, accelerator)  # features adapt it: e.g. LoRA, SyncBatchNorm
    if config.gradient_checkpointing:
        distributed.enable_gradient_checkpointing(model)
    metric = load_metrics(task.metrics if config.metrics is None else config.metrics)
    # eval-only under FSDP2 or ZeRO-1/2 still hands prepare an optimizer (never stepped): Accelerate needs one there
    needs_optimizer = training or strategy.prepare_needs_optimizer(accelerator)
    optimizer = optim.build_optimizer(model, config) if needs_optimizer else None
    model, optimizer, train_loader, eval_loader, test_loader, predict_loader = accelerator.prepare(
        model, optimizer, train_loader, eval_loader, test_loader, predict_loader
    )
    saved_model = model  # without compilation: its state dict's keys are the model's own
    if config.torch_compile:
        model = torch.compile(model, mode=config.torch_compile_mode)  # outside DDP/FSDP, as Accelerate's dynamo_backend
    prepared = train_loader, eval_loader, test_loader, predict_loader
    return Setup(accelerator, task, model, saved_model, metric, *prepared, predict_split, optimizer)


def train(config: TrainConfig) -> dict:
    """Train, evaluating and checkpointing as configured; returns the final eval (and test) metrics."""
    features.installed().check(config)  # src/features/: each feature's bad input said before training, not after
    run_dir.refuse_to_replace(config, resuming=bool(config.resume_from_checkpoint))  # before the data is read
    run = set_up(config, training=True)
    # e.g. preflight's: the data and the task's eval code tried on a batch, said before any step
    features.installed().before_training(
        run.accelerator, config, run.task, run.saved_model, run.train_loader, run.eval_loader, run.metric
    )
    accelerator, task, model, metric, eval_loader = run.accelerator, run.task, run.model, run.metric, run.eval_loader
    accumulation = accelerator.gradient_accumulation_steps
    global_batch = loaders.global_batch(config, accelerator)  # the same on any process count

    # --- how long: counted in optimiser steps, each seeing the same global batch on any process count ---
    steps_per_epoch = batches.steps_per_epoch(run.train_loader, accumulation)  # None: a stream has no length
    total_steps = config.max_steps if config.max_steps > 0 else math.ceil(config.num_train_epochs * steps_per_epoch)
    lr_scheduler = optim.build_scheduler(run.optimizer, config, total_steps)  # stepped once per optimiser step
    accelerator.register_for_checkpointing(lr_scheduler)
    position = batches.DataPosition()  # where training is in its data: a stream's is in every checkpoint
    if steps_per_epoch is None:
        accelerator.register_for_checkpointing(position)

    # --- resume: weights, optimiser, scheduler and RNG from the checkpoint ---
    state = checkpoint.TrainerState(
        global_batch=global_batch, world_size=accelerator.num_processes, strategy=strategy.strategy_of(model)
    )
    features.installed().before_resume(accelerator, config)  # e.g. a newer checkpoint fetched from object storage
    state, resumed = checkpoint.resume(accelerator, config, state)  # --resume_from_checkpoint: the checkpoint's state
    if resumed:
        optim.follow_config(run.optimizer, lr_scheduler, config)  # its learning rate, not the checkpoint's
    if steps_per_epoch:  # data of known length: the position follows from the step
        position = batches.DataPosition(*divmod(state.step, steps_per_epoch))

    # --- the run directory and trackers: only now that all input has been validated ---
    run_dir.prepare_output_dir(accelerator, config, resume_step=state.step if resumed else None)
    features.installed().on_start(accelerator, config, resumed)
    state.tracker_run_id = tracking.start_tracking(accelerator, config, resume_run_id=state.tracker_run_id)
    tracking.log_metrics(accelerator, tracking.setup_metrics(accelerator, model, config, global_batch), step=state.step)

    # --- train ---
    step, eval_metrics = state.step, {}  # eval_metrics: the latest evaluation's
    meter = meters.TrainMeters(accelerator, model, run.optimizer, config, state)
    best = BestEvaluation(config, state)  # a new best model is checkpointed; early stopping
    total_steps = state.step if best.stopped_early() else total_steps  # resumed after it stopped early: done
    progress = tracking.progress_bar(accelerator, total_steps, initial=step)
    export = partial(task.save_model, accelerator, run.saved_model) if task.export_checkpoints else None
    source = batches.train_data(accelerator, run.train_loader, config, task.collate_fn())  # index_batches': by index
    windows = batches.train_windows(source, accumulation, position) if step < total_steps else []  # []: a run finished
    norm_every_step = bool(config.max_grad_norm or config.skip_nonfinite_batches)  # else at log steps only
    model.train()
    # SIGTERM/SIGUSR1 -> checkpoint (handlers restored however we leave)
    with preemption.PreemptionSignals(accelerator) as signals:
        for window in windows:
            log_next = (step + 1) % config.logging_steps == 0 or step + 1 == total_steps
            measure_norm = norm_every_step or log_next
            grad_norm = train_step(accelerator, task, model, run.optimizer, window, meter, config, measure_norm)
            lr_scheduler.step()
            step += 1
            progress.update()
            features.installed().on_step(accelerator, config, step)  # e.g. the profiler's
            evaluate_now = config.do_eval and (step % config.eval_steps == 0 or step == total_steps)
            new_best = False
            if evaluate_now:
                with meter.timer.paused():
                    eval_metrics = evaluate(task, model, eval_loader, metric, accelerator)
                new_best, stop_early = best.update(eval_metrics, step)
                total_steps = step if stop_early else total_steps  # then the final checkpoint and model follow
            if log_next or step == total_steps:  # an early stop's last steps too
                epoch = step / steps_per_epoch if steps_per_epoch else position.epoch
                logged = meter.log_step(step, lr_scheduler.get_last_lr()[0], grad_norm, epoch)
                logged = features.installed().train_metrics(logged, accelerator, task)  # e.g. throughput's tokens/s
                tracking.log_metrics(accelerator, logged, step)
            if evaluate_now:
                tracking.log_metrics(accelerator, eval_metrics, step)  # after the step's train line
            preempted = signals.requested(step)
            if preempted or new_best or step == total_steps or (config.save_steps and step % config.save_steps == 0):
                state.step, state.preempted = step, preempted
                meter.save_to(state)
                with meter.timer.paused():
                    saved = checkpoint.save_checkpoint(accelerator, config, state, export)
                    features.installed().on_checkpoint(accelerator, config, saved, state)
                if preempted:
                    raise errors.TrainingPreempted(f"checkpoint {saved} saved; run the same command to resume")
            if step >= total_steps:
                break
        progress.close()

        final_metrics = finish_training(run, config, state, best, eval_metrics, step)
    distributed.end_training(accelerator)  # and a moment for gloo's threads: see src/errors.py
    return final_metrics


def train_step(accelerator, task, model, optimizer, window, meter: meters.TrainMeters, config, measure_norm: bool):
    """One optimiser step over an accumulation window; returns the gradient norm when `measure_norm`, else None."""
    # a loss that is a sum: scaled by its terms' count over the global batch (see summed_loss_scale)
    scale = distributed.summed_loss_scale(accelerator, task, window) if task.loss_reduction == "sum" else None
    losses = []
    for batch in window:
        with accelerator.accumulate(model):  # no gradient sync before the window's last micro-batch
            loss = task.loss(model, batch) if scale is None else task.loss(model, batch) * scale
            accelerator.backward(loss)
        losses.append(loss)
    meter.losses.add(losses)  # one value per optimiser step, however many micro-batches it took
    grad_norm = None
    if measure_norm:  # max_norm inf: the norm measured, nothing clipped
        grad_norm = accelerator.clip_grad_norm_(model.parameters(), config.max_grad_norm or math.inf)
    # the same on every process (all-reduced gradients); DeepSpeed may give no norm
    if config.skip_nonfinite_batches and grad_norm is not None and not torch.isfinite(grad_norm).all():
        optimizer.zero_grad()
        meter.skipped_steps += 1
    optimizer.step()
    optimizer.zero_grad()
    return grad_norm


def finish_training(run: Setup, config, state: checkpoint.TrainerState, best: BestEvaluation, metrics: dict, step):
    """After the last step (signals no longer stop it): the best model if asked, model/, `finish`, features' on_end."""
    accelerator, task, model, output_dir = run.accelerator, run.task, run.model, Path(config.output_dir)
    if config.do_eval and not metrics:  # a finished run resumed: nothing trained, evaluate again
        metrics = evaluate(task, model, run.eval_loader, run.metric, accelerator)
        tracking.log_metrics(accelerator, metrics, step)
    if config.load_best_model_at_end and state.best_model_step is not None:
        if state.best_model_step != step:  # else the model is the best already
            accelerator.load_state(str(checkpoint.checkpoint_dir(output_dir, state.best_model_step)))
            metrics = evaluate(task, model, run.eval_loader, run.metric, accelerator)  # equal to the best's: a check
        tracking.log_metrics(accelerator, best.summary(), step)
    model_dir = final_model.save_final_model(accelerator, task, run.saved_model, output_dir)  # before more is read
    logger.info("model saved to %s; metrics in %s", model_dir, output_dir / run_dir.METRICS_FILE)
    metrics = finish(run, config, metrics, step)
    features.installed().on_end(accelerator, config, model_dir)  # e.g. uploads: object storage, the Hub
    return metrics


def predict(args: list[str] | TrainConfig) -> list[dict]:
    """predictions.jsonl's rows from Python, e.g. `predict(["--data_files", "{test: new.parquet}"])`; trains nothing."""
    only = {"do_train": False, "do_eval": False, "do_predict": True}
    if isinstance(args, TrainConfig):
        config = parse_config(replace(args, **only))
    else:
        config = parse_config([*(f"--{name}={value}" for name, value in only.items()), *args])
    config = final_model.model_to_evaluate(config)  # where the rows go: a checkpoint's into its own folder
    with tasks.task_errors(tasks.task_class(config.task)):
        evaluate_and_predict(config)
    return [json.loads(line) for line in (Path(config.output_dir) / run_dir.PREDICTIONS_FILE).read_text().splitlines()]


def evaluate_and_predict(config: TrainConfig) -> dict:
    """`--do_train false`: evaluate and/or predict with a saved model (--model_name_or_path, by default the run's
    model/). Reads only the splits it uses; writes only eval_results.json and predictions.jsonl."""
    config = final_model.model_to_evaluate(config)  # a run's folder: its own model, never another's results there
    run_dir.check_writable(Path(config.output_dir))  # said now, not after the evaluation
    run = set_up(config, training=False)  # no trackers: the results go to eval_results.json
    logger.info("using the model in %s; nothing is trained", config.model_name_or_path)
    metrics = {}
    if config.do_eval:
        metrics = evaluate(run.task, run.model, run.eval_loader, run.metric, run.accelerator)
        tracking.log_metrics(run.accelerator, metrics, step=0)
    metrics = finish(run, config, metrics, step=0)
    errors.let_threads_settle(run.accelerator.num_processes)  # before the model is freed: see src/errors.py
    return metrics


def finish(run: Setup, config: TrainConfig, metrics: dict, step: int) -> dict:
    """After training or instead of it: the test split's metrics, eval_results.json, predictions.jsonl; all metrics."""
    accelerator, task, output_dir = run.accelerator, run.task, Path(config.output_dir)
    if run.test_loader is not None:
        test_metrics = evaluate(task, run.model, run.test_loader, run.metric, accelerator, prefix="test")
        tracking.log_metrics(accelerator, test_metrics, step)
        metrics = {**metrics, **test_metrics}
    if metrics:
        results = json.dumps(metrics, indent=2) + "\n"
        run_dir.write_atomically(accelerator, output_dir / run_dir.EVAL_RESULTS_FILE, results)
    if run.predict_loader is not None:
        rows = with_ids(predictions(task, run.model, run.predict_loader, accelerator), task, run.predict_split)
        path = output_dir / run_dir.PREDICTIONS_FILE
        run_dir.write_atomically(accelerator, path, "".join(json.dumps(row) + "\n" for row in rows))
        logger.info("%d predictions of the %s split written to %s", len(rows), run.predict_split, path)
    return metrics


@torch.no_grad()
def evaluate(task, model, eval_loader, metric, accelerator, prefix: str = "eval") -> dict:
    """Exact metrics over the whole split: every process gathers all outputs, the padding dropped."""
    model.eval()
    loss_sum, weight_sum = torch.zeros((), device=accelerator.device), torch.zeros((), device=accelerator.device)
    num_samples = 0
    for batch in eval_loader:
        outputs = accelerator.gather_for_metrics(task.eval_outputs(model, batch))
        loss_sum += outputs["loss"].sum()
        weight_sum += outputs["weight"].sum()
        num_samples += len(outputs["loss"])
        if metric is not None:
            metric.add_batch(
                predictions=outputs["predictions"].cpu().numpy(), references=outputs["references"].cpu().numpy()
            )
    model.train()
    scores = {"eval/loss": (loss_sum / weight_sum).item()}
    if metric is not None:
        scores |= {f"eval/{name}": value for name, value in metric.compute().items()}
    scores |= task.derived_metrics(scores) | {"eval/num_samples": num_samples}
    return {f"{prefix}/{key.removeprefix('eval/')}": value for key, value in scores.items()}


@torch.no_grad()
def predictions(task, model, loader, accelerator) -> list[dict]:
    """task.predict() over every sample once, in input order (gather_for_metrics drops padding), on every process."""
    model.eval()
    outputs = [accelerator.gather_for_metrics(task.predict(model, batch)) for batch in loader]
    model.train()
    gathered = {name: torch.cat([batch[name] for batch in outputs]).cpu() for name in outputs[0]} if outputs else {}
    return task.prediction_rows(gathered)


def with_ids(rows: list[dict], task, split: str) -> list[dict]:
    """Each row with its input row's id first (`--id_column`), when the task finds ids for the split's rows."""
    ids = task.prediction_ids(split)
    if ids is None:
        logger.info(
            "the rows follow the %s split's order: it has no ids (--id_column %s)", split, task.config.id_column
        )
        return rows
    if len(ids) < len(rows):  # not one per row: the rows as they are
        return rows
    return [{task.config.id_column: id_, **row} for id_, row in zip(ids[: len(rows)], rows, strict=True)]


if __name__ == "__main__":
    try:
        errors.command_line(main)()
    finally:
        gc.freeze()  # exit without the collector traversing every object torch & co. imported (docs/benchmark.md)
