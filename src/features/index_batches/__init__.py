"""Train data held in tensors batched by index (gather.py; docs/benchmark.md): each batch one gather at the prepared
loader's indices, the same batches as its DataLoader at a fraction of the cost per step. Without this feature (or with
`--dataloader_index_batches false`) the loop takes the DataLoader's batches."""

from dataclasses import dataclass

from src.features import Feature


@dataclass
class IndexBatchesOptions:
    dataloader_index_batches: bool = True  # train data in tensors: each batch one gather by the sampler's indices


class IndexBatchesFeature(Feature):
    Options = IndexBatchesOptions

    def train_batches(self, accelerator, loader, config, collate_fn):
        """A dataset that gathers (tensors; no collate_fn of the task's) batched by index, else None: the loader's."""
        if not self.options(config).dataloader_index_batches or collate_fn is not None:
            return None
        from src.features.index_batches.gather import IndexBatches, gatherable

        dataset = gatherable(loader.dataset)
        return None if dataset is None else IndexBatches(loader, dataset, accelerator.device)


FEATURE = IndexBatchesFeature()
