"""The index_batches feature (src/features/index_batches/): in-memory data batched by index gives the DataLoader's
batches: the same samples in the same order, the same shards on N processes, the same resume, hence the same per-step
losses (which tests/test_checkpoint.py checks end to end: a killed run, resumed on the index path, against the
DataLoader's)."""

from types import SimpleNamespace

import pytest
import torch
from torch.utils.data import DataLoader, Subset

from src.batches import LoaderBatches
from src.cli import resolve
from src.config import TrainConfig
from src.features.index_batches.gather import EpochOrder, IndexBatches, gatherable, known_sequence
from src.tasks import build_task
from tests.helpers import assert_gathers_as_collated


@pytest.fixture(scope="module")
def digits():
    return build_task(resolve(TrainConfig())).build_datasets()[0]  # 1,438 train images, labels


def prepared(dataset, processes: int, rank: int, drop_last: bool = True, **loader_options) -> DataLoader:
    """What `accelerator.prepare` makes of a shuffled train loader on process `rank` of `processes`."""
    from accelerate.data_loader import prepare_data_loader

    loader = DataLoader(dataset, batch_size=50, drop_last=drop_last, **({"shuffle": True} | loader_options))
    return prepare_data_loader(loader, num_processes=processes, process_index=rank, put_on_device=False,
                               use_seedable_sampler=True, data_seed=7)  # fmt: skip


def both_ways(dataset, processes: int, rank: int, drop_last: bool, epoch: int, skip: int) -> tuple[list, list]:
    """One epoch of one process's batches from the prepared DataLoader and by index, from batch `skip` on."""
    from accelerate.data_loader import skip_first_batches

    loader = prepared(dataset, processes, rank, drop_last)
    accelerator = SimpleNamespace(skip_first_batches=skip_first_batches)
    by_loader = list(LoaderBatches(accelerator, loader).epoch(epoch, skip))
    index_batches = IndexBatches(loader, gatherable(dataset), torch.device("cpu"))
    assert index_batches.order.positions is not None  # computed, not drawn (see the test below)
    return by_loader, list(index_batches.epoch(epoch, skip))


@pytest.mark.parametrize("processes", [1, 2, 3])
@pytest.mark.parametrize("drop_last", [True, False])  # False: a short last batch, or shards padded from the start
def test_index_batches_are_the_dataloaders(fresh_accelerate_state, digits, processes, drop_last):
    for rank in range(processes):
        for epoch, skip in ((0, 0), (1, 0), (1, 5), (6, 0), (6, 7)):  # a permutation per epoch; resumed epochs
            by_loader, by_index = both_ways(digits, processes, rank, drop_last, epoch, skip)
            assert len(by_index) == len(by_loader) > 0
            for expected, got in zip(by_loader, by_index, strict=True):
                assert type(got) is type(expected) and len(got) == len(expected) == 2
                assert all(torch.equal(g, e) for g, e in zip(got, expected, strict=True)), (rank, epoch, skip)
    assert not torch.equal(both_ways(digits, 1, 0, True, 0, 0)[1][0][1], both_ways(digits, 1, 0, True, 1, 0)[1][0][1])


def test_an_epoch_order_not_known_or_not_checked_is_drawn_from_the_batch_sampler(fresh_accelerate_state, digits):
    """EpochOrder computes an epoch's indices only for a sampler it knows and after checking a second epoch against
    the batch sampler; otherwise (here: a sampler of the user's, and a sequence that the check refutes) it draws
    them, and the batches are still the DataLoader's."""
    import src.features.index_batches.gather as gather

    reversed_order = prepared(digits, 2, 1, shuffle=False, sampler=range(len(digits) - 1, -1, -1))
    assert EpochOrder(reversed_order).positions is None
    assert EpochOrder(prepared(digits, 2, 1, shuffle=False)).positions is not None  # SequentialSampler: known

    def wrong_after_epoch_0(sampler, epoch):  # what a changed seeding in a new Accelerate would look like
        sequence = known_sequence(sampler, 0)
        return sequence if epoch == 0 else sequence.flip(0)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gather, "known_sequence", wrong_after_epoch_0)
        loader = prepared(digits, 2, 1)
        order = EpochOrder(loader)
        assert order.positions is None
        for epoch in (0, 3):
            got = order.indices(epoch)
            loader.set_epoch(epoch)
            assert torch.equal(got, torch.tensor([i for batch in loader.batch_sampler for i in batch]))


def test_subsets_gather_what_default_collate_stacks(digits):
    subset = Subset(digits, range(300))  # --max_train_samples
    assert_gathers_as_collated(subset, gatherable(subset))


def test_samples_fetched_one_by_one_are_not_gathered(digits):
    class Custom(torch.utils.data.TensorDataset):  # may override __getitem__: its samples are its own
        pass

    assert gatherable(Custom(*digits.tensors)) is None
    assert gatherable(Subset(Custom(*digits.tensors), range(3))) is None
