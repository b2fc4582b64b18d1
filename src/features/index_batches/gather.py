"""Train data held in tensors, batched by one gather per batch at the indices the prepared loader's batch sampler
would give (the seedable sampler, Accelerate's shards and padding): the DataLoader's batches without its per-sample
`__getitem__` and `default_collate` calls (docs/benchmark.md)."""

from collections.abc import Iterator
from itertools import chain
from typing import Protocol, runtime_checkable

import numpy as np
import torch
from accelerate.data_loader import SeedableRandomSampler
from accelerate.utils import send_to_device
from torch.utils.data import DataLoader, Dataset, SequentialSampler, Subset, TensorDataset


@runtime_checkable
class Gatherable(Protocol):
    """A dataset whose batch at a tensor of indices is one gather, equal to `default_collate` of those samples."""

    def gather(self, indices: torch.Tensor): ...
    def to(self, device: torch.device) -> "Gatherable": ...  # the same rows, held on `device`
    def nbytes(self) -> int: ...  # the memory its rows take


class TensorRows(TensorDataset):
    """A TensorDataset that gathers a batch, as default_collate stacks it."""

    def gather(self, indices: torch.Tensor) -> list[torch.Tensor]:
        return [tensor.index_select(0, indices) for tensor in self.tensors]  # index_select: cheaper than t[indices]

    def to(self, device: torch.device) -> "TensorRows":
        return TensorRows(*(tensor.to(device) for tensor in self.tensors))

    def nbytes(self) -> int:
        return sum(tensor.nbytes for tensor in self.tensors)


class SubsetRows:
    """`--max_train_samples` on a gatherable dataset, without a copy."""

    def __init__(self, dataset: Gatherable, indices: torch.Tensor):
        self.dataset, self.indices = dataset, indices

    def gather(self, indices: torch.Tensor):
        return self.dataset.gather(self.indices.index_select(0, indices))

    def to(self, device: torch.device) -> "SubsetRows":
        return SubsetRows(self.dataset.to(device), self.indices.to(device))

    def nbytes(self) -> int:
        return self.dataset.nbytes()


def gatherable(dataset: Dataset) -> Gatherable | None:
    """The dataset as one that gathers batches; None when its samples must be fetched one by one."""
    if isinstance(dataset, Subset):
        inner = gatherable(dataset.dataset)
        return None if inner is None else SubsetRows(inner, torch.as_tensor(dataset.indices))
    if isinstance(dataset, Gatherable):
        return dataset
    return TensorRows(*dataset.tensors) if type(dataset) is TensorDataset else None  # a subclass may change __getitem__


class EpochOrder:
    """This process's sample indices for an epoch in one tensor (the loader's batch sampler takes a Python step per
    sample). A batch sampler, Accelerate's shards and padding too, takes the same *positions* of its sampler's sequence
    each epoch: read on epoch 0, checked on 1, they make an epoch one randperm where that is known; else drawn."""

    def __init__(self, loader: DataLoader):
        self.loader = loader
        inner = getattr(loader.batch_sampler, "batch_sampler", None)  # the one inside Accelerate's BatchSamplerShard
        self.sampler = getattr(loader.batch_sampler, "sampler", None) or getattr(inner, "sampler", None)
        first = self.drawn(0)
        self.sizes = [len(indices) for indices in first]  # the same every epoch
        sequence = known_sequence(self.sampler, 0)  # a permutation: its argsort is its inverse
        self.positions = None if sequence is None else torch.argsort(sequence)[flatten(first)]
        if self.positions is not None and not torch.equal(self.indices(1), flatten(self.drawn(1))):
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
    """The sampler's sequence for `epoch` as its code makes it (SequentialSampler, SeedableRandomSampler); else None."""
    if type(sampler) is SequentialSampler:
        return torch.arange(len(sampler.data_source))
    if type(sampler) is SeedableRandomSampler and not sampler.replacement:
        size = len(sampler.data_source)
        if sampler.num_samples == size and (sampler.generator is None or sampler.generator.device.type == "cpu"):
            return torch.randperm(size, generator=torch.Generator().manual_seed(sampler.initial_seed + epoch))
    return None


def flatten(batches: list[list[int]]) -> torch.Tensor:
    return torch.from_numpy(np.fromiter(chain.from_iterable(batches), dtype=np.int64))  # cheaper than torch.tensor


class IndexBatches:
    """The batches of src/batches.py's `LoaderBatches`, each one gather; on a GPU, rows taking at most a quarter of its
    free memory move there once. Unlike the DataLoader this draws no worker seed from torch's global RNG, so dropout
    masks differ."""

    def __init__(self, loader: DataLoader, dataset: Gatherable, device: torch.device):
        self.order, self.device = EpochOrder(loader), device
        self.on_device = device.type == "cpu" or dataset.nbytes() <= torch.cuda.mem_get_info(device)[0] / 4
        self.dataset = dataset.to(device) if self.on_device else dataset

    def epoch(self, epoch: int, skip: int = 0) -> Iterator:
        sizes = self.order.sizes
        flat = self.order.indices(epoch)[sum(sizes[:skip]) :]  # a resumed epoch: from batch `skip` on
        if self.on_device:
            return map(self.dataset.gather, flat.to(self.device).split(sizes[skip:]))
        batches = map(self.dataset.gather, flat.split(sizes[skip:]))
        return (send_to_device(batch, self.device, non_blocking=True) for batch in batches)
