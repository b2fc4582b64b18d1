"""Before the first step, on every process: the first train samples read and batched, one eval batch through the
task's `eval_outputs`, and the watched metrics checked against what evaluation will log. A bug there is one line in
seconds (docs/errors.md), not a failure at the first batch or, hours of steps later, at the first evaluation."""

import torch
from accelerate.utils import send_to_device
from torch.utils.data import DataLoader, IterableDataset, default_collate

from src.best import watched
from src.errors import RunStopped, TaskFailed, describe, one_line
from src.features import Feature
from src.metrics import BUILT_IN, Metric, Metrics


class Preflight(Feature):
    def before_training(self, accelerator, config, task, model, train_loader, eval_loader, metric) -> None:
        if not isinstance(train_loader.dataset, IterableDataset):  # a stream (a feature's) is read as it trains
            check_first_batch(train_loader, task, config.per_device_train_batch_size)
        check_watched_metrics(config, task, metric)
        if config.do_eval:
            check_eval_outputs(task, model, eval_loader, metric, accelerator)


def check_first_batch(loader: DataLoader, task, batch_size: int) -> None:
    """Collate one batch before training: a sample format the collate_fn can't batch is one line, not a traceback."""
    try:
        samples = [loader.dataset[i] for i in range(min(batch_size, len(loader.dataset)))]
    except RunStopped:
        raise
    except Exception as err:  # e.g. an image file that does not decode
        raise TaskFailed(f"reading the first samples failed: {type(err).__name__}: {one_line(err)[:400]}") from err
    try:
        (loader.collate_fn or default_collate)(samples)
    except Exception as err:
        raise TaskFailed(
            f"{type(task).__name__}: batching samples failed ({type(err).__name__}: {one_line(err)}); "
            f"a sample is {describe(samples[0])}; samples of different sizes need a collate_fn that pads "
            "(override the task's collate_fn(), e.g. DataCollatorWithPadding)"
        ) from err


def known_keys(metric: Metric | None) -> list[str] | None:
    """The keys compute() gives, where they are known before evaluating (the built-in metrics'); None where an
    `evaluate` metric's are known only once it has computed."""
    parts = [] if metric is None else metric if isinstance(metric, Metrics) else [metric]
    if not all(isinstance(part, tuple(BUILT_IN.values())) for part in parts):
        return None
    return [key for part in parts for key in part.keys]


def check_watched_metrics(config, task, metric: Metric | None) -> None:
    """A watched metric that no evaluation will log (a misspelt `--metric_for_best_model`), refused before training
    where the eval keys are known: the built-in metrics' and the task's derived ones. Else the first evaluation
    says it."""
    keys = known_keys(metric)
    if keys is None:
        return
    scores = {"eval/loss": 1.0, **{f"eval/{key}": 0.5 for key in keys}}
    try:
        logged = {**scores, **task.derived_metrics(scores), "eval/num_samples": 1}  # derived from made-up scores
    except Exception:  # the task's own code on made-up scores: its keys are left for the first evaluation to find
        return
    if config.metric_for_best_model:
        watched(logged, config.metric_for_best_model, "--metric_for_best_model")
    if config.early_stopping_patience:
        watched(logged, config.early_stopping_metric, "--early_stopping_metric")


@torch.no_grad()
def check_eval_outputs(task, model, eval_loader, metric, accelerator) -> None:
    """One eval batch through `task.eval_outputs` before training: its bug, or outputs evaluation can't use, is said
    now, not at the first evaluation, after steps the last checkpoint may not hold. The random generators it draws
    from (a loader's seed, a task's own draws) are put back: the training that follows is as without it."""
    from torch.distributed.fsdp import FSDPModule

    device = accelerator.device
    on_device = [] if device.type == "cpu" else [device.index or 0]
    with torch.random.fork_rng(on_device, device_type=device.type):
        batches = iter(eval_loader.base_dataloader)  # this process's share, read as evaluation reads it
        batch = next(batches, None)
        del batches  # a loader's workers end with their iterator
        if batch is None:  # an iterable split with nothing for this process: evaluation says so
            return
        model.eval()
        try:
            outputs = task.eval_outputs(model, send_to_device(batch, device))
        finally:
            model.train()
            if isinstance(model, FSDPModule):  # FSDP2 leaves the root unsharded after a forward, for a backward
                model.reshard()
    needed = ["loss", "weight", *(["predictions", "references"] if metric is not None else [])]
    name = f"{type(task).__name__}.eval_outputs()"
    if not isinstance(outputs, dict) or any(key not in outputs for key in needed):
        raise TaskFailed(
            f"{name} gave {describe(outputs)}; it must give a dict of {', '.join(needed)} (docs/customize.md)"
        )
    per_sample = all(torch.is_tensor(outputs[key]) and outputs[key].ndim > 0 for key in needed)
    if not per_sample or len({outputs[key].shape[0] for key in needed}) > 1:
        shapes = ", ".join(f"{key}: {describe(outputs[key])}" for key in needed)
        raise TaskFailed(
            f"{name} gave {{{shapes}}}; each must be a tensor of one value per sample, the batch along dim 0 (e.g. a "
            "loss with reduction='none')"
        )


FEATURE = Preflight()
