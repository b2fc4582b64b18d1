"""Data: `datasets.load_dataset` on local Parquet/CSV/JSON files or a Hub name, then PyTorch DataLoaders.

`load_splits` reads whatever the config names; each task (src/tasks/) turns the splits into torch Datasets and may
bring its own `collate_fn`.
Accelerate shards the loaders across processes later, in `accelerator.prepare`; nothing here knows about ranks.
Training data held in tensors skips the DataLoader's per-sample fetch: `train_data` gathers each batch with the
prepared loader's own indices (`IndexBatches`), so the batches, their order and the sharding stay the loader's.
"""

import os
from collections.abc import Iterable, Iterator
from itertools import chain
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, SequentialSampler, Subset, TensorDataset, default_collate

from src.config import TrainConfig
from src.errors import TaskFailed, UsageError, describe

FILE_BUILDERS = {".parquet": "parquet", ".csv": "csv", ".json": "json", ".jsonl": "json"}


def load_splits(config: TrainConfig, names: list[str] | None = None):
    """A `datasets.DatasetDict` holding the splits `names` (default: train and eval) of the data the config names.
    Local files of other splits are not read: an evaluation without training never touches the train split."""
    import datasets

    datasets.disable_progress_bars()
    names = names or [config.train_split, config.eval_split]
    splits = load_hub_dataset(config) if config.dataset_name else None
    available = list(splits if splits is not None else config.data_files)
    missing = [name for name in names if name not in available]
    if missing:
        raise missing_split(config, missing[0], available)
    if splits is None:  # local files: only those of the named splits are read
        files = {split: config.data_files[split] for split in names}
        builder = file_builder(files)
        try:
            splits = datasets.load_dataset(builder, data_files=files)
        except datasets.exceptions.DatasetGenerationError as err:
            cause = " ".join(str(err.__cause__ or err).split())
            raise UsageError(f"could not read the {builder} data files ({cause}); check --data_files") from err
    for split in names:
        if len(splits[split]) == 0:
            raise UsageError(f"the {split!r} split is empty; point --data_files or --dataset_name at data with rows")
    return splits


def has_split(config: TrainConfig, name: str) -> bool:
    """Whether the data holds split `name` (the optional test split)."""
    if config.dataset_name:
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
    """The `datasets` builder for local files, from their extension; all splits must share one format."""
    suffixes = set()
    for split, path in data_files.items():
        if not Path(path).is_file():
            raise UsageError(
                f"data file for split {split!r} not found: {path} (set --data_files or run from the repo root)"
            )
        suffixes.add(Path(path).suffix.lower())
    unsupported = suffixes - set(FILE_BUILDERS)
    if unsupported or len(suffixes) != 1:
        raise UsageError(
            f"data_files must all be one of {', '.join(FILE_BUILDERS)} (got {', '.join(sorted(suffixes))})"
        )
    return FILE_BUILDERS[suffixes.pop()]


def load_hub_dataset(config: TrainConfig):
    """Fail in a second, not after ~23 s of retries, when the Hub can't be reached and nothing is cached."""
    import datasets

    name = config.dataset_name
    check_hub_repo(name, "dataset", flag="--dataset_name", instead="use --data_files")
    return datasets.load_dataset(name, config.dataset_config_name)


def check_hub_repo(name: str, kind: str, flag: str, instead: str) -> None:
    """A Hub dataset or model that isn't cached: one request with a 10 s timeout, not ~23 s of retries.
    `kind`: "dataset" or "model"; `instead`: what to do offline."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import RepositoryNotFoundError

    if is_cached(name, kind):
        return
    if hub_offline():
        raise UsageError(f"{kind} {name!r} is not in the local cache and HF_HUB_OFFLINE is set; {instead}")
    try:
        getattr(HfApi(), f"{kind}_info")(name, timeout=10)
    except RepositoryNotFoundError as err:
        raise UsageError(f"no {kind} {name!r} on the Hugging Face Hub; check {flag}") from err
    except Exception as err:  # DNS, proxy, timeout, HTTP: all mean "can't use the Hub from here"
        raise UsageError(
            f"cannot reach the Hugging Face Hub for {kind} {name!r} ({type(err).__name__}); "
            f"{instead}, or a cached copy with HF_HUB_OFFLINE=1"
        ) from err


def hub_offline() -> bool:
    """HF_HUB_OFFLINE as set now (huggingface_hub's own constant is read once, at its import)."""
    return os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "")


def is_cached(name: str, kind: str = "dataset") -> bool:
    from huggingface_hub.constants import HF_HUB_CACHE

    return (Path(HF_HUB_CACHE) / f"{kind}s--{name.replace('/', '--')}").exists()


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


# --- training batches: by index for data in tensors, else from the DataLoader ---


@runtime_checkable
class Gatherable(Protocol):
    """A dataset whose batch is one gather by a tensor of indices: what `default_collate` makes of the samples at
    those indices, without fetching them one by one. `TensorDataset`s qualify as they are (see `gatherable`)."""

    def gather(self, indices: torch.Tensor): ...

    def to(self, device: torch.device) -> "Gatherable": ...  # the same rows, held on `device`

    def nbytes(self) -> int: ...  # the memory its rows take


class TensorRows(TensorDataset):
    """A TensorDataset that gathers a batch: each tensor's rows at `indices`, as default_collate stacks them."""

    def gather(self, indices: torch.Tensor) -> list[torch.Tensor]:
        return [tensor.index_select(0, indices) for tensor in self.tensors]  # index_select: half of t[indices]

    def to(self, device: torch.device) -> "TensorRows":
        return TensorRows(*(tensor.to(device) for tensor in self.tensors))

    def nbytes(self) -> int:
        return sum(tensor.nbytes for tensor in self.tensors)


class SubsetRows:
    """`--max_train_samples` on a gatherable dataset: its first rows, gathered without a copy."""

    def __init__(self, dataset: Gatherable, indices: torch.Tensor):
        self.dataset, self.indices = dataset, indices

    def gather(self, indices: torch.Tensor):
        return self.dataset.gather(self.indices.index_select(0, indices))

    def to(self, device: torch.device) -> "SubsetRows":
        return SubsetRows(self.dataset.to(device), self.indices.to(device))

    def nbytes(self) -> int:
        return self.dataset.nbytes()


def gatherable(dataset: Dataset) -> Gatherable | None:
    """The dataset as one that gathers batches, or None when its samples must be fetched one by one."""
    if isinstance(dataset, Subset):
        inner = gatherable(dataset.dataset)
        return None if inner is None else SubsetRows(inner, torch.as_tensor(dataset.indices))
    if isinstance(dataset, Gatherable):
        return dataset
    if type(dataset) is TensorDataset:  # a subclass may override __getitem__
        return TensorRows(*dataset.tensors)
    return None


class LoaderBatches:
    """The prepared DataLoader, epoch by epoch; a resumed epoch skips the batches already trained on."""

    def __init__(self, accelerator, loader: DataLoader):
        self.accelerator, self.loader = accelerator, loader

    def epoch(self, epoch: int, skip: int = 0) -> Iterable:
        self.loader.set_epoch(epoch)  # the seedable sampler's permutation: a function of the seed and the epoch
        return self.accelerator.skip_first_batches(self.loader, skip) if skip else self.loader


class EpochOrder:
    """This process's sample indices for an epoch, in one tensor: those the prepared loader's batch sampler yields.

    Drawn from the batch sampler they cost ~0.1 us a sample in Python generators: on the benchmark's tiny model
    the template ran at 0.95x the raw index loop drawing them, 1.01x with them precomputed (medians of 5 rounds).
    Computed, an epoch costs one randperm and one gather: a batch sampler, Accelerate's sharding and padding
    included, arranges the *positions* of its sampler's sequence the same way every epoch, so the positions are read
    once from epoch 0 and an epoch's indices are its sequence at those positions. The sequence is computed for the
    samplers whose order is known (`known_sequence`) and checked against the batch sampler on a second epoch at the
    start; any other sampler, or a failed check, is drawn from as before.
    """

    def __init__(self, loader: DataLoader):
        self.loader = loader
        self.sampler = getattr(loader.batch_sampler, "sampler", None) or getattr(
            getattr(loader.batch_sampler, "batch_sampler", None), "sampler", None
        )  # a BatchSampler's, or the one inside Accelerate's BatchSamplerShard
        first = self.drawn(0)
        self.sizes = [len(indices) for indices in first]  # the same every epoch
        self.positions = None
        sequence = known_sequence(self.sampler, 0)
        if sequence is not None:
            self.positions = torch.argsort(sequence)[flatten(first)]  # argsort of a permutation: its inverse
            if not torch.equal(self.indices(1), flatten(self.drawn(1))):
                self.positions = None

    def drawn(self, epoch: int) -> list[list[int]]:
        self.loader.set_epoch(epoch)  # the seedable sampler's permutation: a function of the seed and the epoch
        return list(self.loader.batch_sampler)

    def indices(self, epoch: int) -> torch.Tensor:
        if self.positions is None:
            return flatten(self.drawn(epoch))
        self.loader.set_epoch(epoch)  # as drawing would: the loader's state is the same either way
        return known_sequence(self.sampler, epoch)[self.positions]


def known_sequence(sampler, epoch: int) -> torch.Tensor | None:
    """The sampler's whole sequence for `epoch` as its own code computes it, or None when not known here:
    Accelerate's SeedableRandomSampler (one randperm, its generator seeded with its seed + the epoch) and the
    SequentialSampler (no shuffling)."""
    from accelerate.data_loader import SeedableRandomSampler

    if type(sampler) is SequentialSampler:
        return torch.arange(len(sampler.data_source))
    if type(sampler) is SeedableRandomSampler and not sampler.replacement:
        size = len(sampler.data_source)
        if sampler.num_samples == size and (sampler.generator is None or sampler.generator.device.type == "cpu"):
            generator = torch.Generator().manual_seed(sampler.initial_seed + epoch)
            return torch.randperm(size, generator=generator)
    return None


def flatten(batches: list[list[int]]) -> torch.Tensor:
    return torch.from_numpy(np.fromiter(chain.from_iterable(batches), dtype=np.int64))  # 1/8 of torch.tensor's time


class IndexBatches:
    """The same batches as `LoaderBatches`, each one gather by the indices of the prepared loader's batch sampler
    (the seedable sampler, sharded across processes by Accelerate: the same order, shards and padding; `EpochOrder`).

    A DataLoader batch of 64 small samples costs ~0.5 ms of per-sample calls and stacking on a CPU, about what a
    tiny model's whole step costs; a gather costs ~10 us. On a GPU, rows that take at most a quarter of its free
    memory are moved there once. (The DataLoader also draws a worker seed from torch's global RNG for each epoch's
    iterator; this path does not, so a model with dropout draws other masks here than through the DataLoader.)
    """

    def __init__(self, loader: DataLoader, dataset: Gatherable, device: torch.device):
        self.order, self.device = EpochOrder(loader), device
        self.on_device = device.type == "cpu" or dataset.nbytes() <= torch.cuda.mem_get_info(device)[0] / 4
        self.dataset = dataset.to(device) if self.on_device else dataset

    def epoch(self, epoch: int, skip: int = 0) -> Iterator:
        sizes = self.order.sizes
        flat = self.order.indices(epoch)[sum(sizes[:skip]) :]  # a resumed epoch: from batch `skip` on
        flat = flat.to(self.device) if self.on_device else flat
        batches = map(self.dataset.gather, flat.split(sizes[skip:]))
        if self.on_device:
            return batches
        from accelerate.utils import send_to_device

        return (send_to_device(batch, self.device, non_blocking=True) for batch in batches)


def train_data(accelerator, loader: DataLoader, config: TrainConfig, collate_fn) -> IndexBatches | LoaderBatches:
    """Batches by index when the data is in tensors and default_collate batches it; else the DataLoader's."""
    dataset = gatherable(loader.dataset) if config.dataloader_index_batches and collate_fn is None else None
    if dataset is None:
        return LoaderBatches(accelerator, loader)
    return IndexBatches(loader, dataset, accelerator.device)
