"""Data: `datasets.load_dataset` on local Parquet/CSV/JSON files, image folders or a Hub name, then PyTorch DataLoaders.

`load_splits` reads whatever the config names; each task (src/tasks/) turns the splits into torch Datasets and may
bring its own `collate_fn`. Tasks whose data becomes tensors take `load_tables` instead: Parquet without `datasets`.
Accelerate shards the loaders across processes later, in `accelerator.prepare`; nothing here knows about ranks.
Training data held in tensors skips the DataLoader's per-sample fetch: `train_data` gathers each batch with the
prepared loader's own indices (`IndexBatches`), so the batches, their order and the sharding stay the loader's.
"""

import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import NamedTuple, Protocol, runtime_checkable

from torch.utils.data import DataLoader, Dataset, IterableDataset, Subset, default_collate

from src import features
from src.config import TrainConfig
from src.errors import TaskFailed, UsageError, describe
from src.hub import check_hub_repo

logger = logging.getLogger(__name__)

FILE_BUILDERS = {".parquet": "parquet", ".csv": "csv", ".json": "json", ".jsonl": "json"}
FOLDER_BUILDER = "imagefolder"  # a folder as a split's data_files: its images, labelled by their class subfolders
LOCAL_BUILDERS = {*FILE_BUILDERS.values(), FOLDER_BUILDER}  # --dataset_name naming one reads --data_files, not the Hub


def load_splits(config: TrainConfig, names: list[str] | None = None):
    """A `datasets.DatasetDict` holding the splits `names` (default: train and eval) of the data the config names.
    Local files of other splits are not read: an evaluation without training never touches the train split."""
    import datasets

    datasets.disable_progress_bars()
    names = names or [config.train_split, config.eval_split]
    local = local_files(config, names)
    if local is None:
        splits = load_hub_dataset(config)
        missing = [name for name in names if name not in splits]
        if missing:
            raise missing_split(config, missing[0], list(splits))
    else:  # local files: only those of the named splits are read
        files, builder = local
        if builder == FOLDER_BUILDER:  # datasets reads a folder's files through a pattern
            files = {split: str(Path(folder) / "**") for split, folder in files.items()}
        try:
            splits = datasets.load_dataset(builder, data_files=files)
        except datasets.exceptions.DatasetGenerationError as err:
            raise unreadable(builder, err.__cause__ or err) from err
    for split in names:
        check_rows(len(splits[split]), split)
    return splits


def load_tables(config: TrainConfig, names: list[str] | None = None, columns: list[str] | None = None) -> dict:
    """The splits `names` (default: train and eval) as pyarrow Tables, for tasks that turn columns into tensors
    (`column_tensor`); `columns`: only those of them the split has. Local Parquet files are read by pyarrow itself, as
    datasets' Parquet builder does, without importing `datasets` (docs/benchmark.md); all other data through
    load_splits."""
    names = names or [config.train_split, config.eval_split]
    local = local_files(config, names)
    if local is None or local.builder != "parquet":
        splits = load_splits(config, names)
        return {name: splits[name].data.table.select(present(columns, splits[name].column_names)) for name in names}
    import pyarrow as pa
    import pyarrow.parquet as pq

    tables = {}
    for split, path in local.files.items():
        try:  # one file; read_table would import pyarrow.dataset and pandas
            with pq.ParquetFile(path) as parquet:
                check_rows(parquet.metadata.num_rows, split)
                tables[split] = parquet.read(columns=present(columns, parquet.schema_arrow.names))
        except pa.ArrowException as err:
            raise unreadable("parquet", err) from err
    return tables


def present(columns: list[str] | None, names: list[str]) -> list[str]:
    """Those of `columns` (all if None) that a table with columns `names` has."""
    return names if columns is None else [name for name in columns if name in names]


class LocalFiles(NamedTuple):
    files: dict[str, str]  # split -> its file or folder
    builder: str  # the `datasets` builder that reads them: parquet, csv, json, imagefolder


def local_files(config: TrainConfig, names: list[str]) -> LocalFiles | None:
    """The data files of splits `names` and their `datasets` builder; None for a Hub dataset. A split the files lack,
    a missing file or a --dataset_name that doesn't read them: a UsageError."""
    if not reads_local_files(config):
        return None
    missing = [name for name in names if name not in config.data_files]
    if missing:
        raise missing_split(config, missing[0], list(config.data_files))
    files = {split: config.data_files[split] for split in names}
    builder = file_builder(files)
    if config.dataset_name not in (None, builder):
        raise UsageError(f"--dataset_name {config.dataset_name} does not read {builder} data_files; drop it")
    return LocalFiles(files, builder)


def unreadable(builder: str, cause: BaseException) -> UsageError:
    return UsageError(f"could not read the {builder} data files ({' '.join(str(cause).split())}); check --data_files")


def check_rows(rows: int, split: str) -> None:
    if rows == 0:
        raise UsageError(f"the {split!r} split is empty; point --data_files or --dataset_name at data with rows")


def column_tensor(table, name: str, split: str, missing_as_nan: bool = True):
    """Column `name` of a pyarrow Table as a tensor, as datasets' torch format gives it: integers int64, floats
    float32, booleans bool; lists of one length (nested too) a dimension each; missing floats NaN (unless
    `missing_as_nan` is False: labels). Through DLPack: pyarrow's to_numpy() would import pandas. Other missing
    values, lists of different lengths or values that are not numbers: a UsageError naming the column."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import torch

    column, shape = table.column(name).combine_chunks(), [len(table)]
    while isinstance(column.type, (pa.ListType, pa.LargeListType, pa.FixedSizeListType)):
        lengths = pc.unique(pc.list_value_length(column))
        if column.null_count or len(lengths) > 1:
            raise UsageError(f"column {name!r} of the {split} split holds lists of different lengths or none")
        column, shape = column.flatten(), [*shape, lengths[0].as_py() if len(lengths) else 0]
    if column.null_count and pa.types.is_floating(column.type) and missing_as_nan:  # as datasets gives them
        column = pc.fill_null(column, float("nan"))
    if column.null_count:
        raise UsageError(f"column {name!r} has {column.null_count} missing values in the {split} split; fill them")
    is_bool = pa.types.is_boolean(column.type)
    if is_bool:  # bit-packed in Arrow: DLPack takes bytes
        column = pc.cast(column, pa.uint8())
    if not (pa.types.is_integer(column.type) or pa.types.is_floating(column.type)):
        raise UsageError(f"column {name!r} of the {split} split holds {column.type}, not numbers; choose other columns")
    dtype = torch.bool if is_bool else torch.int64 if pa.types.is_integer(column.type) else torch.float32
    return torch.from_dlpack(column).view(shape).to(dtype, copy=True)  # a copy: Arrow's memory is read-only


def reads_local_files(config: TrainConfig) -> bool:
    """--data_files without --dataset_name, or with a `datasets` builder of local files as its name (`imagefolder`,
    `parquet`, ...): the files are read, the Hub is never asked."""
    if config.dataset_name not in (None, *LOCAL_BUILDERS):
        return False
    if not config.data_files:
        if config.dataset_name is None:
            raise no_data(config)
        raise UsageError(
            f"--dataset_name {config.dataset_name} reads local files: set --data_files, e.g. "
            "'{train: data/my_images/train, eval: data/my_images/eval}'"
        )
    return True


def no_data(config: TrainConfig) -> UsageError:
    """Asked for data files or a dataset, and the config names neither (the task has no default_data_files)."""
    return UsageError(f"no data for --task {config.task}: set --data_files (local files) or --dataset_name")


def has_split(config: TrainConfig, name: str) -> bool:
    """Whether the data holds split `name` (the optional test split); no data named: none (the task's own data)."""
    if not (config.data_files or config.dataset_name):
        return False
    if not reads_local_files(config):
        return name in load_hub_dataset(config)
    return name in config.data_files


def missing_split(config: TrainConfig, name: str, available: list[str]) -> UsageError:
    """The error for a split the data lacks (read in full or streamed), naming the flag that fixes it."""
    where = "set" if config.dataset_name else "add it to --data_files or set"
    flag = split_flag(config, name)
    return UsageError(f"the data has no split {name!r} (it has {', '.join(available)}); {where} {flag}")


def split_flag(config: TrainConfig, split: str) -> str:
    if split == config.train_split:
        return "--train_split"
    if split == config.eval_split:
        return "--eval_split (or --do_eval false)" if not config.do_train else "--eval_split"
    return "--test_split"


def file_builder(data_files: dict[str, str]) -> str:
    """The `datasets` builder for local files, from their extension (a folder: imagefolder); all splits must share
    one format."""
    suffixes = set()
    for split, path in data_files.items():
        if Path(path).is_dir():
            suffixes.add("a folder")
            continue
        if not Path(path).is_file():
            raise UsageError(
                f"data file for split {split!r} not found: {path} (set --data_files or run from the repo root)"
            )
        suffixes.add(Path(path).suffix.lower())
    unsupported = suffixes - {*FILE_BUILDERS, "a folder"}
    if unsupported or len(suffixes) != 1:
        raise UsageError(
            f"data_files must all be one of {', '.join(FILE_BUILDERS)} or all folders of images "
            f"(got {', '.join(sorted(suffixes))})"
        )
    suffix = suffixes.pop()
    return FOLDER_BUILDER if suffix == "a folder" else FILE_BUILDERS[suffix]


def load_hub_dataset(config: TrainConfig):
    """Fail in a second, not after ~23 s of retries, when the Hub can't be reached and nothing is cached."""
    import datasets

    name = config.dataset_name
    check_hub_repo(name, "dataset", flag="--dataset_name", instead="use --data_files")
    return datasets.load_dataset(name, config.dataset_config_name)


def check_columns(split, wanted: list[str], flags: str) -> None:
    """A UsageError naming the absent columns, the ones the data has and the flags that choose them."""
    missing = set(wanted) - set(split.column_names)
    if missing:
        raise UsageError(
            f"the data has no column {', '.join(sorted(missing))} (it has {', '.join(split.column_names)}); set {flags}"
        )


def build_dataloaders(train_set: Dataset, eval_set: Dataset, config: TrainConfig, collate_fn=None, pin_memory=False):
    """pin_memory (for a GPU): batches are collated into page-locked memory, which the GPU copies from without
    the host waiting (Accelerate's non_blocking transfer, see distributed.py)."""
    if config.max_train_samples:
        train_set = Subset(train_set, range(min(config.max_train_samples, len(train_set))))
    train_loader = DataLoader(
        train_set,
        batch_size=config.per_device_train_batch_size,
        shuffle=True,  # Accelerate replaces the sampler with a seedable one: same order on 1 or N processes
        drop_last=config.dataloader_drop_last,
        num_workers=config.dataloader_num_workers,
        collate_fn=collate_fn,
        pin_memory=pin_memory,
    )
    return train_loader, build_eval_loader(eval_set, config, collate_fn, config.max_eval_samples, pin_memory)


def global_batch(config: TrainConfig, accelerator) -> int:
    """The samples of one optimiser step over all processes: per-device batch x processes x accumulation."""
    return config.per_device_train_batch_size * accelerator.num_processes * accelerator.gradient_accumulation_steps


def build_loaders(task, config: TrainConfig, accelerator, training: bool, pin_memory: bool = False):
    """(train loader, eval loader) before `prepare`: the train loader when training (a feature's own, e.g. a stream
    with --streaming, else over the task's datasets in memory), the eval loader when training or evaluating. Data in
    memory is checked first: at least one global batch, fewer processes than eval samples, a first batch that
    collates."""
    train_loader = features.installed().train_loader(task, config, pin_memory) if training else None
    if training and train_loader is None:
        train_set, eval_set = task.build_datasets()
        collate_fn = task.collate_fn()  # after the datasets: e.g. a padding collator needs the tokenizer they loaded
        train_loader, eval_loader = build_dataloaders(train_set, eval_set, config, collate_fn, pin_memory)
        check_split_sizes(train_loader, eval_loader, global_batch(config, accelerator), accelerator.num_processes)
        check_first_batch(train_loader, task)
        return train_loader, eval_loader
    if not (training or config.do_eval):
        return train_loader, None
    eval_set = task.build_eval_dataset(config.eval_split)
    return train_loader, build_eval_loader(eval_set, config, task.collate_fn(), config.max_eval_samples, pin_memory)


def steps_per_epoch(loader: DataLoader, accumulation: int) -> int | None:
    """Optimiser steps in an epoch of the train loader (whole accumulation windows), or None for a stream."""
    return None if isinstance(loader.dataset, IterableDataset) else len(loader) // accumulation


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


def check_first_batch(loader: DataLoader, task) -> None:
    """Collate one batch before training: a sample format the collate_fn can't batch is one line, not a traceback."""
    dataset = loader.dataset
    samples = [dataset[i] for i in range(min(loader.batch_size or 1, len(dataset)))]
    try:
        (loader.collate_fn or default_collate)(samples)
    except Exception as err:
        raise TaskFailed(
            f"{type(task).__name__}: batching samples failed ({type(err).__name__}: {' '.join(str(err).split())}); "
            f"a sample is {describe(samples[0])}; samples of different sizes need a collate_fn that pads "
            "(override the task's collate_fn(), e.g. DataCollatorWithPadding)"
        ) from err


def check_split_sizes(train_loader: DataLoader, eval_loader: DataLoader, global_batch: int, num_processes: int) -> None:
    """Before `prepare`: a train split without one global batch, or fewer eval samples than processes, is an error."""
    train_size, eval_size = len(train_loader.dataset), len(eval_loader.dataset)
    if train_size < global_batch:
        raise UsageError(
            f"the train split has {train_size} samples, fewer than one global batch of {global_batch}; "
            "lower --global_batch_size / --per_device_train_batch_size or use more data"
        )
    if eval_size < num_processes:
        raise UsageError(
            f"the eval split has {eval_size} samples, fewer than the {num_processes} processes; "
            "use a larger eval split or fewer processes"
        )
    left_out = train_size % global_batch  # an epoch is whole global batches: the rest waits for the next epoch
    if left_out > 0.1 * train_size:
        logger.warning(
            "the train split's %d samples fill %d global batches of %d an epoch: %d (%.0f%%) are left out of each "
            "epoch (others each time, the order being shuffled); lower --global_batch_size to use more of them",
            *(train_size, train_size // global_batch, global_batch, left_out, 100 * left_out / train_size),
        )


def build_test_loader(task, config: TrainConfig, pin_memory: bool = False):
    """The labelled test split, evaluated at the end, when the data has one and --do_eval is on; else None."""
    if not (config.do_eval and has_split(config, config.test_split)):
        return None
    dataset = task.build_eval_dataset(config.test_split)
    return build_eval_loader(dataset, config, task.collate_fn(), config.max_predict_samples, pin_memory)


def predicted_split(config: TrainConfig) -> str | None:
    """What --do_predict predicts: the test split, or the eval split where the data has no test split."""
    if not config.do_predict:
        return None
    return config.test_split if has_split(config, config.test_split) else config.eval_split


def build_predict_loader(task, config: TrainConfig, split: str | None):
    """The task's prediction inputs of `split` (unlabelled: prompts for a language model, not its eval blocks), one
    per input row, in order; None without a split to predict."""
    if split is None:
        return None
    inputs = task.build_eval_dataset(split, labelled=False)
    return build_eval_loader(inputs, config, task.collate_fn(), config.max_predict_samples)


# --- training batches, in whole accumulation windows ---


@dataclass
class DataPosition:
    """Where training is in its data: the epoch, and the optimiser steps already taken in it. For data of known
    length it follows from the step; a stream's is saved in every checkpoint (`register_for_checkpointing`)."""

    epoch: int = 0
    steps: int = 0

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "steps": self.steps}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.steps = state["epoch"], state["steps"]


def train_windows(source, accumulation: int, position: DataPosition) -> Iterator[list]:
    """The micro-batches of each optimiser step, a whole accumulation window at a time, epoch after epoch, from
    `position` on (a resumed epoch skips the batches already trained on). An epoch's trailing partial window is
    skipped, so every step sees one global batch. Runs until the caller stops; `position` moves with it.

    `source.epoch(epoch, skip)`: an epoch's batches (`LoaderBatches`, or src/index_batches.py's `IndexBatches`); the
    seedable sampler (or a stream's shuffle) makes them a function of the seed and the epoch.
    """
    while True:
        batches = iter(source.epoch(position.epoch, skip=position.steps * accumulation))
        while len(window := list(islice(batches, accumulation))) == accumulation:
            position.steps += 1  # counted before training on it: a checkpoint follows the step
            yield window
        if position.steps == 0:
            raise UsageError(
                "the train data holds fewer samples than one global batch; use more data or a smaller batch"
            )
        position.epoch, position.steps = position.epoch + 1, 0


@runtime_checkable
class EpochDependent(Protocol):
    """A dataset whose samples depend on the epoch, e.g. augmentation drawn from a generator seeded by the seed, the
    epoch and the sample's index (the image_classification task). `LoaderBatches` sets the epoch before each
    epoch's iterator exists, so the loader's worker processes, which copy the dataset as the iterator starts, see it;
    a resumed run sets the epoch it resumes in. (Accelerate's prepared loader calls a dataset's set_epoch itself only
    where the sampler has none; a shuffled train loader's seedable sampler has one, so it never reaches the dataset.)"""

    def set_epoch(self, epoch: int) -> None: ...


class LoaderBatches:
    """The prepared DataLoader, epoch by epoch; a resumed epoch skips the batches already trained on."""

    def __init__(self, accelerator, loader: DataLoader):
        self.accelerator, self.loader = accelerator, loader

    def epoch(self, epoch: int, skip: int = 0) -> Iterable:
        self.loader.set_epoch(epoch)  # the seedable sampler's permutation: a function of the seed and the epoch
        dataset = self.loader.dataset.dataset if isinstance(self.loader.dataset, Subset) else self.loader.dataset
        if isinstance(dataset, EpochDependent):
            dataset.set_epoch(epoch)
        return self.accelerator.skip_first_batches(self.loader, skip) if skip else self.loader
