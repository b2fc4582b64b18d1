"""Train batches in whole accumulation windows, and where training is in its data (the epoch, the step in it)."""

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from itertools import islice
from typing import Protocol, runtime_checkable

from torch.utils.data import DataLoader, IterableDataset, Subset

from src import features
from src.config import TrainConfig
from src.errors import UsageError


@dataclass
class DataPosition:
    """The epoch and the optimiser steps taken in it: from the step for sized data; a stream's is checkpointed."""

    epoch: int = 0
    steps: int = 0

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "steps": self.steps}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.steps = state["epoch"], state["steps"]


def train_windows(source, accumulation: int, position: DataPosition) -> Iterator[list]:
    """Each optimiser step's micro-batches from `position` on, which moves with it; an epoch's trailing partial window
    is skipped, so every step sees one global batch. `source.epoch(epoch, skip)`: a function of seed and epoch."""
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
    """Optimiser steps (whole accumulation windows) in an epoch of the train loader; None for a stream."""
    return None if isinstance(loader.dataset, IterableDataset) else len(loader) // accumulation


@runtime_checkable
class EpochDependent(Protocol):
    """A dataset whose samples depend on the epoch (e.g. image_classification's augmentation): `LoaderBatches` sets it
    before the epoch's iterator exists, so the workers' copies see it (a prepared loader sets only its sampler's)."""

    def set_epoch(self, epoch: int) -> None: ...


class LoaderBatches:
    """The prepared DataLoader; a resumed epoch skips the batches already trained on."""

    def __init__(self, accelerator, loader: DataLoader):
        self.accelerator, self.loader = accelerator, loader

    def epoch(self, epoch: int, skip: int = 0) -> Iterable:
        self.loader.set_epoch(epoch)  # the seedable sampler's permutation: a function of the seed and the epoch
        dataset = self.loader.dataset.dataset if isinstance(self.loader.dataset, Subset) else self.loader.dataset
        if isinstance(dataset, EpochDependent):
            dataset.set_epoch(epoch)
        return self.accelerator.skip_first_batches(self.loader, skip) if skip else self.loader


def train_data(accelerator, loader: DataLoader, config: TrainConfig, collate_fn):
    """The prepared train loader's batches: a feature's cheaper source of the same batches (index_batches), else its
    own."""
    cheaper = features.installed().train_batches(accelerator, loader, config, collate_fn)
    return LoaderBatches(accelerator, loader) if cheaper is None else cheaper
