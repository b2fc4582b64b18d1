"""Training batches, a whole accumulation window at a time: from the prepared DataLoader (`LoaderBatches`) or, for
data held in tensors, one gather per batch with the indices the loader's own batch sampler would yield
(`IndexBatches`): the same batches, order, shards and padding, without the per-sample calls and stacking (about what
a tiny model's whole step costs on a CPU: docs/benchmark.md). tests/test_index_batches.py and the 1-vs-N tests check
that both give the same numbers; this module reads the structure of Accelerate's prepared loaders to do so.
"""

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from itertools import chain, islice
from typing import Protocol, runtime_checkable

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, SequentialSampler, Subset, TensorDataset

from src.config import TrainConfig
from src.errors import UsageError


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
    `source.epoch(epoch, skip)`: an epoch's batches, a function of the seed and the epoch (the seedable sampler, or a
    stream's shuffle)."""
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


def steps_per_epoch(loader: DataLoader, accumulation: int) -> int | None:
    """Optimiser steps in an epoch of the train loader (whole accumulation windows), or None for a stream."""
    return None if isinstance(loader.dataset, IterableDataset) else len(loader) // accumulation


@runtime_checkable
class EpochDependent(Protocol):
    """A dataset whose samples depend on the epoch, e.g. augmentation drawn from a generator seeded by the seed, the
    epoch and the sample's index (the image_classification task). `LoaderBatches` sets the epoch before each epoch's
    iterator exists, so the loader's worker processes, which copy the dataset as the iterator starts, see it. (A
    prepared loader calls a dataset's set_epoch itself only where the sampler has none; the seedable sampler has.)"""

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


@runtime_checkable
class Gatherable(Protocol):
    """A dataset whose batch is one gather by a tensor of indices: what `default_collate` makes of the samples at
    those indices. `TensorDataset`s qualify as they are (`gatherable`)."""

    def gather(self, indices: torch.Tensor): ...

    def to(self, device: torch.device) -> "Gatherable": ...  # the same rows, held on `device`

    def nbytes(self) -> int: ...  # the memory its rows take


class TensorRows(TensorDataset):
    """A TensorDataset that gathers a batch: each tensor's rows at `indices`, as default_collate stacks them."""

    def gather(self, indices: torch.Tensor) -> list[torch.Tensor]:
        return [tensor.index_select(0, indices) for tensor in self.tensors]  # index_select: cheaper than t[indices]

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


class EpochOrder:
    """This process's sample indices for an epoch, in one tensor: those the prepared loader's batch sampler yields.

    Drawn from the batch sampler they cost Python generator steps per sample; computed, one randperm and one gather. A
    batch sampler (Accelerate's sharding and padding included) arranges the *positions* of its sampler's sequence the
    same way every epoch, so they are read once from epoch 0, and an epoch's indices are its sequence at them. The
    sequence is computed where the sampler's order is known (`known_sequence`) and checked against the batch sampler
    on a second epoch at the start; any other sampler, or a failed check, is drawn from.
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
    """The sampler's whole sequence for `epoch` as its own code computes it, or None: Accelerate's
    SeedableRandomSampler (one randperm, its generator seeded with its seed + the epoch), the SequentialSampler."""
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
    return torch.from_numpy(np.fromiter(chain.from_iterable(batches), dtype=np.int64))  # cheaper than torch.tensor


class IndexBatches:
    """The same batches as `LoaderBatches`, each one gather by the indices of the prepared loader's batch sampler
    (`EpochOrder`). On a GPU, rows that take at most a quarter of its free memory are moved there once. (The
    DataLoader also draws a worker seed from torch's global RNG for each epoch's iterator; this path does not, so a
    model with dropout draws other masks here than through the DataLoader.)
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
