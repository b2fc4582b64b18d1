"""`--streaming`: the train split read as a stream, for data bigger than memory or disk.

    python scripts/make_shards.py --out data/shards --num_shards 16       # once: a multi-shard corpus
    python train.py --task causal_lm --streaming true --max_steps 200 \
        --data_files '{train: data/shards/train-*.parquet, eval: data/stdlib/eval.parquet}'

The task's `build_train_stream()` gives a `datasets` IterableDataset (`load_dataset(..., streaming=True)` over the
files a glob names, or a Hub dataset), shuffled with a buffer and the seed; the eval split stays map-style.
- Across processes: Accelerate's IterableDatasetShard (`dispatch_batches=False`, src/distributed.py): every process
  reads the whole stream and keeps its slice of each group of per-device batch x processes samples. A step's global
  batch is then the same consecutive samples of the stream on 1 or N processes, and each sample is used once (the
  price: each process reads and tokenises all of it; `split_dataset_by_node` by shards would read 1/N each, but
  then the global batches, and so the losses, would depend on the process count).
- Across data-loader workers: `datasets` gives each worker its own files (so use more shards than workers).
- Exact resume: the stream is a function of the seed and the epoch, so its position is (epoch, batches read in
  that epoch). It is saved in every checkpoint (`register_for_checkpointing`) and a resumed run reads and drops
  the batches already trained on: no shuffle buffer to save, at the cost of re-reading the epoch up to there.
"""

import glob
from dataclasses import dataclass
from itertools import islice
from pathlib import Path

from torch.utils.data import DataLoader, IterableDataset

from src.config import TrainConfig
from src.distributed import summed_loss_scale
from src.errors import UsageError


def load_stream(config: TrainConfig, split: str):
    """One split as a `datasets` IterableDataset: local files (glob patterns allowed) or a Hub dataset."""
    import datasets

    from src.data import FILE_BUILDERS, check_hub_repo, missing_split

    datasets.disable_progress_bars()
    if config.dataset_name:
        check_hub_repo(config.dataset_name, "dataset", flag="--dataset_name", instead="use --data_files")
        return datasets.load_dataset(config.dataset_name, config.dataset_config_name, split=split, streaming=True)
    pattern = config.data_files.get(split)
    if pattern is None:
        raise missing_split(config, split, list(config.data_files))
    files = sorted(glob.glob(pattern))
    if not files:
        raise UsageError(f"no file matches the {split} data_files pattern {pattern} (run from the repo root?)")
    suffixes = {Path(file).suffix.lower() for file in files}
    if len(suffixes) != 1 or not suffixes <= set(FILE_BUILDERS):
        raise UsageError(f"the {split} files must all be one of {', '.join(FILE_BUILDERS)} (got {sorted(suffixes)})")
    return datasets.load_dataset(FILE_BUILDERS[suffixes.pop()], data_files={split: files}, split=split, streaming=True)


class SampleStream(IterableDataset):
    """A `datasets` IterableDataset whose examples become samples (e.g. tensors) through `to_sample`; `set_epoch`
    reaches the stream, whose shard order and shuffle buffer depend on the seed and the epoch."""

    def __init__(self, stream, to_sample):
        self.stream, self.to_sample = stream, to_sample  # to_sample: a module-level function, for worker processes

    def set_epoch(self, epoch: int) -> None:
        self.stream.set_epoch(epoch)

    def __iter__(self):
        return map(self.to_sample, self.stream)  # datasets reads only this worker's shards in a worker process


def build_stream_loader(task, config: TrainConfig, pin_memory: bool = False) -> DataLoader:
    """The train loader over the task's stream; full batches only (a stream has no length to pad to)."""
    if config.max_train_samples:
        raise UsageError("--max_train_samples does not apply with --streaming; --max_steps sets how much is read")
    return DataLoader(
        task.build_train_stream(),
        batch_size=config.per_device_train_batch_size,
        drop_last=True,
        num_workers=config.dataloader_num_workers,
        collate_fn=task.collate_fn(),
        pin_memory=pin_memory,
    )


@dataclass
class StreamPosition:
    """Where the stream is: its epoch and the (per-process) batches of that epoch already trained on.
    Registered with `accelerator.register_for_checkpointing`, so every checkpoint holds it."""

    epoch: int = 0
    batches: int = 0

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "batches": self.batches}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.batches = state["epoch"], state["batches"]


def stream_batches(accelerator, task, loader, position: StreamPosition):
    """(micro-batch, scale) in whole accumulation windows, epoch after epoch, from `position` on; like train.py's
    train_batches, which it mirrors (an epoch's trailing partial window is skipped). Runs until the caller stops."""
    accumulation = accelerator.gradient_accumulation_steps
    while True:
        loader.set_epoch(position.epoch)
        batches = iter(accelerator.skip_first_batches(loader, position.batches) if position.batches else loader)
        windows = 0
        while len(window := list(islice(batches, accumulation))) == accumulation:
            position.batches += accumulation  # counted before training on them: a checkpoint follows the window
            windows += 1
            scale = None if task.loss_reduction == "mean" else summed_loss_scale(accelerator, task, window)
            yield from ((batch, scale) for batch in window)
        if windows == 0 and position.batches == 0:
            raise UsageError(
                "the train stream holds fewer samples than one global batch; use more data or a smaller batch"
            )
        position.epoch, position.batches = position.epoch + 1, 0
