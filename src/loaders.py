"""The DataLoaders (train, eval, test, predict), checked before training; `accelerator.prepare` shards them later.
pin_memory (for a GPU): batches collated into page-locked memory, which the GPU copies without the host waiting."""

import logging

from torch.utils.data import DataLoader, Dataset, Subset

from src import features, strategy
from src.config import TrainConfig
from src.data import MissingColumns, has_split
from src.errors import UsageError

logger = logging.getLogger(__name__)


def global_batch(config: TrainConfig, accelerator) -> int:
    """Samples per optimiser step: device batch x accumulation x data-parallel size (tensor-parallel ranks share)."""
    processes = strategy.data_parallel_size(accelerator.num_processes)
    return config.per_device_train_batch_size * processes * accelerator.gradient_accumulation_steps


def build_loaders(task, config: TrainConfig, accelerator, training: bool, pin_memory: bool = False):
    """(train, eval) loaders before `prepare`, None if unused: train a feature's (a stream) or the task's, checked."""
    train_loader = features.installed().train_loader(task, config, pin_memory) if training else None
    if training and train_loader is None:
        train_set, eval_set = task.build_datasets()
        collate_fn = task.collate_fn()  # after the datasets: e.g. a padding collator needs the tokenizer they loaded
        train_loader, eval_loader = build_dataloaders(train_set, eval_set, config, collate_fn, pin_memory)
        check_split_sizes(train_loader, eval_loader if config.do_eval else None, global_batch(config, accelerator))
        return train_loader, eval_loader
    if not (training or config.do_eval):
        return train_loader, None
    eval_set = task.build_eval_dataset(config.eval_split)
    return train_loader, build_eval_loader(eval_set, config, task.collate_fn(), config.max_eval_samples, pin_memory)


def build_dataloaders(train_set: Dataset, eval_set: Dataset, config: TrainConfig, collate_fn=None, pin_memory=False):
    if config.max_train_samples:
        train_set = Subset(train_set, range(min(config.max_train_samples, len(train_set))))
    # shuffle: Accelerate replaces the sampler with a seedable one, the same order on 1 or N processes
    train_loader = DataLoader(
        train_set,
        batch_size=config.per_device_train_batch_size,
        shuffle=True,
        drop_last=config.dataloader_drop_last,
        num_workers=config.dataloader_num_workers,
        collate_fn=collate_fn,
        pin_memory=pin_memory,
    )
    return train_loader, build_eval_loader(eval_set, config, collate_fn, config.max_eval_samples, pin_memory)


def build_eval_loader(dataset: Dataset, config: TrainConfig, collate_fn=None, max_samples=None, pin_memory=False):
    """In order, every sample once: after `prepare`, `gather_for_metrics` drops the padding of uneven shards."""
    if max_samples:
        dataset = Subset(dataset, range(min(max_samples, len(dataset))))
    return DataLoader(
        dataset,
        batch_size=config.per_device_eval_batch_size,
        num_workers=config.dataloader_num_workers,
        collate_fn=collate_fn,
        pin_memory=pin_memory,
    )


def build_test_and_predict_loaders(task, config: TrainConfig, pin_memory: bool = False):
    """(test loader, predicted split, predict loader), None if not asked: the labelled test split if the data has one
    and --do_eval (one without labels is only predicted); --do_predict's split (test, else eval) as unlabelled inputs
    (an LM's prompts), in order."""
    has_test = (config.do_eval or config.do_predict) and has_split(config, config.test_split)
    test_loader = predict_split = predict_loader = inputs = None
    if config.do_eval and has_test:
        labelled, inputs = labelled_split(task, config.test_split, config.do_predict)  # inputs: lacks labels, read once
        if labelled is not None:
            test_loader = build_eval_loader(labelled, config, task.collate_fn(), config.max_predict_samples, pin_memory)
    if config.do_predict:
        predict_split = config.test_split if has_test else config.eval_split
        inputs = task.build_eval_dataset(predict_split, labelled=False) if inputs is None else inputs
        predict_loader = build_eval_loader(inputs, config, task.collate_fn(), config.max_predict_samples, pin_memory)
    return test_loader, predict_split, predict_loader


def labelled_split(task, split: str, predicted: bool) -> tuple[Dataset | None, Dataset | None]:
    """(the split with its labels, None); or, said in a warning, (None, its inputs) where it lacks the labels only."""
    try:
        return task.build_eval_dataset(split), None
    except MissingColumns as missing:
        inputs = task.build_eval_dataset(split, labelled=False)  # lacking more than the labels: that error
        logger.warning("no test/ metrics: %s; %s", missing.what,
                       "it is only predicted" if predicted else "--do_predict true predicts it")  # fmt: skip
        return None, inputs


def check_split_sizes(train_loader: DataLoader, eval_loader: DataLoader | None, global_batch: int) -> None:
    """Before `prepare`: a train split without one global batch, or an evaluated split without samples, is an error
    (fewer eval samples than processes are not: their shares are padding, which `gather_for_metrics` drops)."""
    train_size = len(train_loader.dataset)
    if eval_loader is not None and len(eval_loader.dataset) == 0:
        raise UsageError("the eval split has no samples; give it some, or train without evaluating: --do_eval false")
    if train_size < global_batch:
        more = "raise --max_train_samples" if isinstance(train_loader.dataset, Subset) else "use more data"
        raise UsageError(
            f"the train split has {train_size} samples, fewer than one global batch of {global_batch}; "
            f"lower --global_batch_size / --per_device_train_batch_size or {more}"
        )
    left_out = train_size % global_batch  # an epoch is whole global batches: the rest waits for the next epoch
    if left_out > 0.1 * train_size:
        logger.warning(
            "the train split's %d samples fill %d global batches of %d an epoch: %d (%.0f%%) are left out of each "
            "epoch (others each time, the order being shuffled); lower --global_batch_size to use more of them",
            *(train_size, train_size // global_batch, global_batch, left_out, 100 * left_out / train_size),
        )
