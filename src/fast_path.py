"""The fast path: what the template does instead of the textbook loop's per-step overhead, behind one boundary.

Everything here gives the same numbers as the plain way (tests/test_index_batches.py and the 1-vs-N tests check
it), and this is the only module that reads Accelerate's private structure to do so:
- Index batches (`train_data`): training data held in tensors is batched by one gather per batch, with the indices
  the prepared loader's own batch sampler would yield (`EpochOrder`): the same batches, order, shards and padding.
- The direct optimizer calls (`DirectOptimizer`): plain torch calls where Accelerate's per-step wrappers would do
  nothing but cost time; Accelerate's own calls where they do real work (DeepSpeed, FSDP, fp16 scaling, XLA).
- The allocator setting (`keep_freed_host_memory`): glibc keeps freed activations instead of returning them to the
  OS at every step.
What each costs and gains, measured: docs/benchmark.md.
"""

import contextlib
import math
import os
from collections.abc import Iterator
from itertools import chain
from typing import Protocol, runtime_checkable

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, SequentialSampler, Subset, TensorDataset

from src.config import TrainConfig
from src.data import LoaderBatches


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

    Drawing them from the batch sampler costs Python generator steps per sample (docs/benchmark.md). Computed, an
    epoch costs one randperm and one gather: a batch sampler, Accelerate's sharding and padding included, arranges
    the *positions* of its sampler's sequence the same way every epoch, so the positions are read once from epoch 0
    and an epoch's indices are its sequence at those positions. The sequence is computed for the samplers whose
    order is known (`known_sequence`) and checked against the batch sampler on a second epoch at the start; any
    other sampler, or a failed check, is drawn from.
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
    return torch.from_numpy(np.fromiter(chain.from_iterable(batches), dtype=np.int64))  # cheaper than torch.tensor


class IndexBatches:
    """The same batches as `LoaderBatches`, each one gather by the indices of the prepared loader's batch sampler
    (the seedable sampler, sharded across processes by Accelerate: the same order, shards and padding; `EpochOrder`).

    A DataLoader batch of small samples costs per-sample calls and stacking on a CPU, about what a tiny model's
    whole step costs; a gather costs a small fraction of it (docs/benchmark.md). On a GPU, rows that take at most a
    quarter of its free memory are moved there once. (The DataLoader also draws a worker seed from torch's global
    RNG for each epoch's iterator; this path does not, so a model with dropout draws other masks here than through
    the DataLoader.)
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


def keep_freed_host_memory() -> None:
    """On the CPU, stop glibc's malloc from giving each step's freed activations back to the OS, only to page-fault
    them in again at the next step: page faults whose count differs from process to process and moves the speed of
    the same loop (docs/benchmark.md). Fixed thresholds stop it: blocks under 32 MB come from the heap (glibc's
    default starts at 128 KB and moves), and up to 1 GB free at its top is kept.
    Peak memory is unchanged; memory freed after the peak may stay with the process. glibc only, and not when
    GLIBC_TUNABLES sets malloc options (yours win)."""
    import ctypes

    libc = os.confstr("CS_GNU_LIBC_VERSION") if "CS_GNU_LIBC_VERSION" in getattr(os, "confstr_names", {}) else ""
    if not libc.startswith("glibc") or "glibc.malloc" in os.environ.get("GLIBC_TUNABLES", ""):
        return
    mallopt = ctypes.CDLL(None).mallopt  # the C library this process runs on
    m_trim_threshold, m_mmap_threshold = -1, -3  # <malloc.h>
    mallopt(m_mmap_threshold, 32 << 20)  # glibc's maximum
    mallopt(m_trim_threshold, 1 << 30)


class DirectOptimizer:
    """The optimizer as the loop uses it: accumulate, backward, clip, step, zero_grad. Plain torch calls on the
    optimizer as built where Accelerate's per-step wrappers would do nothing but cost time (about as much as a tiny
    model's whole step: docs/benchmark.md); under DeepSpeed, FSDP, XLA or an fp16 grad scaler the wrappers do real
    work, and the prepared optimizer's calls are the ones made.
    """

    PLAIN = ("NO", "MULTI_CPU", "MULTI_GPU", "MULTI_XPU")

    def __init__(self, accelerator, model: nn.Module, prepared_optimizer, torch_optimizer: torch.optim.Optimizer):
        self.accelerator = accelerator
        self.model = model
        self.plain = (
            accelerator.distributed_type.value in self.PLAIN
            and accelerator.scaler is None
            and not accelerator.has_lomo_optimizer
        )
        self.optimizer = torch_optimizer if self.plain else prepared_optimizer  # what step() calls
        self.accumulation = accelerator.gradient_accumulation_steps  # fixed for the run; read once, not per step

    def accumulate(self, model: nn.Module):
        """`accelerator.accumulate(model)`; without accumulation every batch is a step and the context would do
        nothing but cost time (docs/benchmark.md), so it is skipped then."""
        if self.accumulation > 1:
            return self.accelerator.accumulate(model)
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        """Inside `accumulate`: the loss is scaled for accumulation, as Accelerate does."""
        if not self.plain:
            return self.accelerator.backward(loss)
        (loss / self.accumulation if self.accumulation > 1 else loss).backward()

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor | None:
        """The total gradient norm (all-reduced gradients: the same on every process), clipped to `max_norm` if it
        is > 0 (0: measured only, not scaling every gradient by 1)."""
        if not self.plain:
            norm = self.accelerator.clip_grad_norm_(self.model.parameters(), max_norm or math.inf)
            return None if norm is None else torch.as_tensor(norm)  # DeepSpeed returns a float or None
        if not max_norm:
            return torch.nn.utils.get_total_norm([p.grad for p in self.model.parameters() if p.grad is not None])
        return torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)

    def step(self) -> None:
        """Call once per optimiser step (when `accelerator.sync_gradients`), not per micro-batch."""
        self.optimizer.step()
        self.zero_grad()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
