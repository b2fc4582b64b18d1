"""Train a model with Hugging Face Accelerate: the same file on a laptop CPU, one GPU, N GPUs or a cluster.

    python train.py                                          # one process
    accelerate launch --config_file accelerate_configs/ddp.yaml train.py --config configs/default.yaml
    python -c "from train import main; main(['--max_steps', '50'])"   # from Python or a notebook
    python train.py --do_train false --do_predict true       # evaluate runs/digits/model, write predictions.jsonl

The story, top to bottom: config -> accelerator -> task (data, model, metric) -> train loop (log, evaluate) -> save.
What is trained is a task (src/tasks/: one class with its data, model, loss and metrics); the machinery around the
loop lives in src/: config.py, distributed.py, strategy.py (DDP, FSDP2, DeepSpeed), optim.py, tracking.py, meters.py,
checkpoint.py, errors.py. Nothing here asks which process it runs on. Edit this loop freely: docs/customize.md
says what must stay for 1 process and N processes to train the same.
"""

import json
import logging
import math
from dataclasses import replace
from functools import partial
from itertools import islice, repeat
from pathlib import Path

import torch

from src.checkpoint import (
    EVAL_RESULTS_FILE,
    METRICS_FILE,
    PREDICTIONS_FILE,
    BestModel,
    PreemptionSignals,
    TrainerState,
    check_hub_push,
    checkpoint_dir,
    find_resume_checkpoint,
    load_checkpoint,
    prepare_output_dir,
    push_to_hub,
    save_checkpoint,
    save_final_model,
    write_atomically,
)
from src.config import TrainConfig, parse_config, resolve
from src.data import (
    build_dataloaders,
    build_eval_loader,
    check_first_batch,
    check_split_sizes,
    has_split,
    train_data,
)
from src.distributed import (
    DirectOptimizer,
    build_accelerator,
    compile_model,
    enable_gradient_checkpointing,
    summed_loss_scale,
    sync_batchnorm,
)
from src.errors import TrainingPreempted, command_line
from src.meters import LossWindow, StepTimer, peak_memory_gb, step_profiler, throughput_metrics
from src.metrics import load_metrics
from src.optim import EarlyStopping, build_optimizer, build_scheduler
from src.strategy import ShardMemory, cast_inputs_for_deepspeed, prepare_needs_optimizer, strategy_of
from src.streaming import StreamPosition, build_stream_loader, stream_batches
from src.tasks import build_task
from src.tasks.base import task_errors
from src.tracking import build_trackers, log_metrics, progress_bar, setup_logging, setup_metrics, start_tracking

logger = logging.getLogger("train")


def main(args: list[str] | TrainConfig | None = None) -> dict:
    """Train and evaluate; returns the final eval metrics. `args`: CLI flags, a TrainConfig, or None (sys.argv)."""
    config = resolve(args) if isinstance(args, TrainConfig) else parse_config(args)
    if not config.do_train:
        return evaluate_and_predict(config)
    if not config.auto_find_batch_size:
        return train(config)
    from accelerate.utils import find_executable_batch_size

    first = per_device = config.per_device_train_batch_size

    def halve() -> int:  # resolve_global_batch then raises the accumulation: the optimiser's batch stays the same
        nonlocal per_device
        per_device //= 2
        logger.warning("out of memory with a per-device batch of %d: retrying with %d", per_device * 2, per_device)
        return per_device

    @find_executable_batch_size(starting_batch_size=first, reduce_batch_size_fn=halve)
    def train_with(batch_size: int) -> dict:  # a retry replaces what the attempt that ran out of memory wrote
        return train(replace(config, per_device_train_batch_size=batch_size,
                             overwrite_output_dir=config.overwrite_output_dir or batch_size != first))  # fmt: skip

    return train_with()


def train(config: TrainConfig) -> dict:
    # --- distributed setup: world size, device, global batch -> gradient accumulation ---
    accelerator = build_accelerator(config, log_with=build_trackers(config))
    setup_logging(accelerator)
    from accelerate.utils import set_seed

    set_seed(config.seed)  # same seed on every process: identical initial weights, like a broadcast
    accumulation = accelerator.gradient_accumulation_steps
    global_batch = config.per_device_train_batch_size * accelerator.num_processes * accumulation

    # --- the task: data, model, metric; then the optimiser ---
    check_hub_push(config)
    task = build_task(config)
    on_gpu = accelerator.device.type == "cuda"
    if config.streaming:  # the train split read as a stream (src/streaming.py): memory bounded, no length
        train_loader = build_stream_loader(task, config, pin_memory=on_gpu)
        eval_set = task.build_eval_dataset(config.eval_split)
        collate_fn = task.collate_fn()
        eval_loader = build_eval_loader(eval_set, config, collate_fn, config.max_eval_samples, on_gpu)
    else:
        train_set, eval_set = task.build_datasets()
        collate_fn = task.collate_fn()  # after the datasets: e.g. a padding collator needs the tokenizer they loaded
        train_loader, eval_loader = build_dataloaders(train_set, eval_set, config, collate_fn, pin_memory=on_gpu)
        check_split_sizes(train_loader, eval_loader, global_batch, accelerator.num_processes)
        check_first_batch(train_loader, task)
    test_loader = build_test_loader(task, config, pin_memory=on_gpu)  # None when the data has no test split
    predict_split = predicted_split(config) if config.do_predict else None  # the test split, else the eval split
    predict_loader = build_predict_loader(task, config, predict_split)  # the task's prediction inputs, or None
    model = task.load_model(config.model_name_or_path) if config.model_name_or_path else task.build_model()
    model = cast_inputs_for_deepspeed(sync_batchnorm(model, accelerator), accelerator)
    if config.gradient_checkpointing:
        enable_gradient_checkpointing(model)
    metric = load_metrics(task.metrics if config.metrics is None else config.metrics)
    model, optimizer, train_loader, eval_loader, test_loader, predict_loader = accelerator.prepare(
        model, build_optimizer(model, config, fused=on_gpu), train_loader, eval_loader, test_loader, predict_loader
    )
    optimizer = DirectOptimizer(accelerator, model, optimizer)  # backward / clip / step without wrapper overhead
    data = None if config.streaming else train_data(accelerator, train_loader, config, collate_fn)  # tensors: by index
    saved_model = model  # what the final model and exports save: the plain module, with or without compilation
    if config.torch_compile:
        model = compile_model(model, config.torch_compile_mode)  # the steps and evaluation, compiled

    # --- how long: counted in optimiser steps, each seeing the same global batch on any process count ---
    # a trailing partial window is skipped, see distributed.py; a stream has no length: max_steps counts
    steps_per_epoch = None if config.streaming else len(train_loader) // accumulation
    total_steps = config.max_steps if config.max_steps > 0 else math.ceil(config.num_train_epochs * steps_per_epoch)
    lr_scheduler = build_scheduler(optimizer.optimizer, config, total_steps)  # stepped once per optimiser step
    accelerator.register_for_checkpointing(lr_scheduler)
    stream_position = StreamPosition()  # --streaming: where the stream is, in every checkpoint
    if config.streaming:
        accelerator.register_for_checkpointing(stream_position)

    # --- resume: weights, optimiser, scheduler and RNG from the checkpoint; the data position from the step ---
    checkpoint = find_resume_checkpoint(config)
    state = TrainerState(global_batch=global_batch, world_size=accelerator.num_processes, strategy=strategy_of(model))
    if checkpoint:
        state = load_checkpoint(accelerator, checkpoint, expected=state)
        logger.info("resuming from %s at step %d", checkpoint, state.step)

    # --- the run directory and trackers: only now that all input has been validated ---
    output_dir = prepare_output_dir(accelerator, config, resume_step=state.step if checkpoint else None)
    state.tracker_run_id = start_tracking(accelerator, config, resume_run_id=state.tracker_run_id)
    log_metrics(accelerator, setup_metrics(accelerator, model, config, global_batch), step=state.step)

    # --- train ---
    step = state.step
    losses = LossWindow(accelerator, accumulation, config.skip_nonfinite_batches)
    losses.load(state.loss_window, state.window_first_step)
    skipped_steps = 0
    timer = StepTimer(step)
    throughput = throughput_metrics(task, accelerator)  # tokens/s and MFU for tasks that count tokens
    shard_memory = ShardMemory(accelerator, model, optimizer)  # each process's parameter and optimiser bytes, once
    early_stopping = EarlyStopping(config, state)
    best_model = BestModel(config, state)  # metric_for_best_model: a new best is checkpointed and kept
    eval_metrics = {}  # the latest evaluation's
    progress = progress_bar(accelerator, total_steps, initial=step)
    norm_every_step = bool(config.max_grad_norm or config.skip_nonfinite_batches)  # else at log steps only
    profiler = step_profiler(config, accelerator)
    profiler.start()
    export = partial(task.save_model, accelerator, saved_model) if task.export_checkpoints else None  # e.g. HF format
    model.train()
    # SIGTERM/SIGUSR1 -> checkpoint (handlers restored however we leave); an error in the task's code -> one line
    with PreemptionSignals(accelerator) as preemption, task_errors(task):
        if step >= total_steps:  # none when resuming a run that has finished: it evaluates and saves again
            batches = []
        elif config.streaming:
            batches = stream_batches(accelerator, task, train_loader, stream_position)
        else:
            batches = train_batches(accelerator, task, data, step, steps_per_epoch)
        for batch, scale in batches:
            with optimizer.accumulate(model):  # accelerator.accumulate: gradients sync on the window's last batch
                loss = task.loss(model, batch) if scale is None else task.loss(model, batch) * scale  # summed losses
                optimizer.backward(loss)
                if accelerator.sync_gradients:
                    log_now = (step + 1) % config.logging_steps == 0 or step + 1 == total_steps
                    grad_norm = optimizer.clip_grad_norm(config.max_grad_norm) if norm_every_step or log_now else None
                    skip = config.skip_nonfinite_batches and not is_finite(grad_norm)  # a host sync: only if asked
                    if skip:  # the same on every process: the norm is of the all-reduced gradients
                        optimizer.zero_grad()
                        skipped_steps += 1
                    optimizer.step()
            losses.add(loss)
            if not accelerator.sync_gradients:
                continue

            # --- one optimiser step done ---
            lr_scheduler.step()
            step += 1
            progress.update()
            profiler.step()
            if log_now:
                train_loss = losses.mean(next_step=step + 1)  # waits for the device: time after it
                step_time = timer.seconds_per_step(step)
                log_metrics(accelerator, {
                    "train/loss": train_loss,
                    "train/lr": lr_scheduler.get_last_lr()[0],
                    **({"train/grad_norm": grad_norm.item()} if grad_norm is not None else {}),
                    "train/samples_per_s": global_batch / step_time,
                    **throughput(global_batch / step_time),
                    "train/step_time_s": step_time,
                    "train/peak_memory_gb": peak_memory_gb(accelerator.device),
                    "epoch": step / steps_per_epoch if steps_per_epoch else stream_position.epoch,
                    **({"train/skipped_steps": skipped_steps} if config.skip_nonfinite_batches else {}),
                    **shard_memory.metrics(),
                }, step)  # fmt: skip
                progress.set_postfix(loss=f"{train_loss:.4f}", samples_per_s=f"{global_batch / step_time:.0f}")
                timer.restart(step)
            new_best = False
            if config.do_eval and (step % config.eval_steps == 0 or step == total_steps):
                with timer.paused():
                    eval_metrics = evaluate(task, model, eval_loader, metric, accelerator)
                    log_metrics(accelerator, eval_metrics, step)
                # the metrics are gathered from all processes, so every process gets the same answer
                new_best = best_model.improved(eval_metrics, step)
                if early_stopping.should_stop(eval_metrics, step):
                    total_steps = step  # finish here: the final checkpoint and model follow
            preempted = preemption.requested(step)
            if preempted or new_best or step == total_steps or (config.save_steps and step % config.save_steps == 0):
                state.step, state.preempted = step, preempted
                state.loss_window, state.window_first_step = losses.state(), losses.first_step  # NaN check too
                with timer.paused():
                    saved = save_checkpoint(accelerator, config, state, export)
                if preempted:
                    raise TrainingPreempted(f"checkpoint {saved} saved; run the same command to resume")
            if step >= total_steps:
                break
        progress.close()
        profiler.stop()

        # --- the final model: the best one if asked; test split, predictions (a signal now changes nothing) ---
        final_metrics = eval_metrics  # the last step's
        if config.do_eval and not final_metrics:  # a finished run resumed: nothing trained, evaluate again
            final_metrics = evaluate(task, model, eval_loader, metric, accelerator)
            log_metrics(accelerator, final_metrics, step)
        if config.load_best_model_at_end and state.best_model_step not in (None, step):
            accelerator.load_state(str(checkpoint_dir(output_dir, state.best_model_step)))
            final_metrics = evaluate(task, model, eval_loader, metric, accelerator)  # equal to the best's: a check
            log_metrics(accelerator, best_model.summary(), step)
        model_dir = save_final_model(accelerator, task, saved_model, output_dir)  # first: what follows reads more data
        logger.info("model saved to %s; metrics in %s", model_dir, output_dir / METRICS_FILE)
        final_metrics = finish(
            accelerator, config, task, model, metric, final_metrics, test_loader, predict_loader, predict_split, step
        )
        push_to_hub(accelerator, config, model_dir)
    accelerator.end_training()
    return final_metrics


def predict(args: list[str] | TrainConfig) -> list[dict]:
    """The rows of predictions.jsonl, from Python: a saved model (by default the run's model/) over the test split,
    e.g. `predict(["--data_files", "{test: new.parquet}"])`. Nothing is trained or evaluated."""
    only = {"do_train": False, "do_eval": False, "do_predict": True}
    if isinstance(args, TrainConfig):
        config = resolve(replace(args, **only))
    else:
        config = parse_config([*(f"--{name}={value}" for name, value in only.items()), *args])
    evaluate_and_predict(config)
    return [json.loads(line) for line in (Path(config.output_dir) / PREDICTIONS_FILE).read_text().splitlines()]


def evaluate_and_predict(config: TrainConfig) -> dict:
    """`--do_train false`: evaluate and/or predict with a saved model (--model_name_or_path, by default the run's
    model/). Reads only the splits it uses; writes only eval_results.json and predictions.jsonl."""
    accelerator = build_accelerator(config)  # no trackers: the results go to eval_results.json
    setup_logging(accelerator)
    task = build_task(config)
    eval_loader = None
    if config.do_eval:
        eval_set = task.build_eval_dataset(config.eval_split)
        eval_loader = build_eval_loader(eval_set, config, task.collate_fn(), config.max_eval_samples)
    test_loader = build_test_loader(task, config)
    predict_split = predicted_split(config) if config.do_predict else None
    predict_loader = build_predict_loader(task, config, predict_split)
    model = cast_inputs_for_deepspeed(task.load_model(config.model_name_or_path), accelerator)
    metric = load_metrics(task.metrics if config.metrics is None else config.metrics)
    unused_optimizer = build_optimizer(model, config) if prepare_needs_optimizer(accelerator) else None  # never stepped
    model, _, eval_loader, test_loader, predict_loader = accelerator.prepare(
        model, unused_optimizer, eval_loader, test_loader, predict_loader
    )
    logger.info("using the model in %s; nothing is trained", config.model_name_or_path)
    with task_errors(task):
        metrics = {}
        if config.do_eval:
            metrics = evaluate(task, model, eval_loader, metric, accelerator)
            log_metrics(accelerator, metrics, step=0)
        return finish(
            accelerator, config, task, model, metric, metrics, test_loader, predict_loader, predict_split, step=0
        )


def build_test_loader(task, config: TrainConfig, pin_memory: bool = False):
    """The labelled test split, evaluated at the end, when the data has one and --do_eval is on; else None."""
    if not (config.do_eval and has_split(config, config.test_split)):
        return None
    dataset = task.build_eval_dataset(config.test_split)
    return build_eval_loader(dataset, config, task.collate_fn(), config.max_predict_samples, pin_memory)


def predicted_split(config: TrainConfig) -> str:
    """--do_predict predicts the test split, or the eval split where the data has no test split."""
    return config.test_split if has_split(config, config.test_split) else config.eval_split


def build_predict_loader(task, config: TrainConfig, split: str | None):
    """The task's prediction inputs of `split` (unlabelled: prompts for a language model, not its eval blocks), one
    per input row, in order; None without a split to predict."""
    if split is None:
        return None
    inputs = task.build_eval_dataset(split, labelled=False)
    return build_eval_loader(inputs, config, task.collate_fn(), config.max_predict_samples)


def finish(
    accelerator,
    config: TrainConfig,
    task,
    model,
    metric,
    metrics: dict,
    test_loader,
    predict_loader,
    predict_split: str | None,
    step,
):
    """After training, or instead of it: the test split's metrics, eval_results.json and, with --do_predict,
    predictions.jsonl of `predict_split`. Returns all the metrics."""
    output_dir = Path(config.output_dir)
    if test_loader is not None:
        test_metrics = evaluate(task, model, test_loader, metric, accelerator, prefix="test")
        log_metrics(accelerator, test_metrics, step)
        metrics = {**metrics, **test_metrics}
    if metrics:
        write_atomically(accelerator, output_dir / EVAL_RESULTS_FILE, json.dumps(metrics, indent=2) + "\n")
    if predict_loader is not None:
        rows = with_ids(predictions(task, model, predict_loader, accelerator), task, predict_split)
        write_atomically(accelerator, output_dir / PREDICTIONS_FILE, "".join(json.dumps(r) + "\n" for r in rows))
        logger.info(
            "%d predictions of the %s split written to %s", len(rows), predict_split, output_dir / PREDICTIONS_FILE
        )
    return metrics


def train_batches(accelerator, task, data, start_step: int, steps_per_epoch: int):
    """(micro-batch, scale) in whole accumulation windows, epoch after epoch, from the one after `start_step`'s.

    The seedable sampler's permutation is a function of the seed and the epoch, so a resumed run skips exactly
    the batches it has trained on. Runs until the caller stops. `scale` is None for a task whose loss is a mean;
    for a summed loss, src/distributed.py's `summed_loss_scale` of the window.
    """
    accumulation = accelerator.gradient_accumulation_steps
    epoch, steps_done = divmod(start_step, steps_per_epoch)
    while True:
        seen = steps_done * accumulation
        batches = islice(data.epoch(epoch, skip=seen), steps_per_epoch * accumulation - seen)
        if task.loss_reduction == "mean":
            yield from zip(batches, repeat(None))  # C-level pairing: no Python frame per batch
        else:
            while window := list(islice(batches, accumulation)):  # the window's micro-batches, read ahead
                yield from zip(window, repeat(summed_loss_scale(accelerator, task, window)))
        epoch, steps_done = epoch + 1, 0


def is_finite(grad_norm: torch.Tensor | None) -> bool:
    return grad_norm is None or bool(torch.isfinite(grad_norm).all())  # DeepSpeed may give no norm


@torch.no_grad()
def evaluate(task, model, eval_loader, metric, accelerator, prefix: str = "eval") -> dict:
    """Exact metrics over the whole split: every process gathers all outputs, the padding dropped."""
    model.eval()
    loss_sum = torch.zeros((), device=accelerator.device)
    weight_sum = torch.zeros((), device=accelerator.device)
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
    scores |= task.derived_metrics(scores)
    scores = {**scores, "eval/num_samples": num_samples}
    return {f"{prefix}/{key.removeprefix('eval/')}": value for key, value in scores.items()}


@torch.no_grad()
def predictions(task, model, loader, accelerator) -> list[dict]:
    """task.predict() over every sample once, in input order, on any process count (gather_for_metrics drops the
    samples that pad uneven shards). Every process returns all rows."""
    model.eval()
    outputs = [accelerator.gather_for_metrics(task.predict(model, batch)) for batch in loader]
    model.train()
    gathered = {name: torch.cat([batch[name] for batch in outputs]).cpu() for name in outputs[0]} if outputs else {}
    return task.prediction_rows(gathered)


def with_ids(rows: list[dict], task, split: str) -> list[dict]:
    """Each row with its input row's id first (`--id_column`), when the task finds ids for the split's rows."""
    ids = task.prediction_ids(split)
    if ids is None or len(ids) < len(rows):  # no ids, or not one per row: the rows as they are
        return rows
    column = task.config.id_column
    return [{column: id_, **row} for id_, row in zip(ids[: len(rows)], rows, strict=True)]


if __name__ == "__main__":
    command_line(main)()
