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
- Exact resume: the stream is a function of the seed and the epoch, so its position is (epoch, steps taken in
  that epoch): src/batches.py's `DataPosition`, saved in every checkpoint. A resumed run reads and drops the batches
  already trained on: no shuffle buffer to save, at the cost of re-reading the epoch up to there. A step is the
  same global batch on any process count, so the position is too.
"""

import glob
from pathlib import Path

from torch.utils.data import IterableDataset

from src.config import TrainConfig
from src.data import FILE_BUILDERS, missing_split, no_data
from src.errors import UsageError
from src.hub import check_hub_repo


def load_stream(config: TrainConfig, split: str):
    """One split as a `datasets` IterableDataset: local files (glob patterns allowed) or a Hub dataset."""
    import datasets

    datasets.disable_progress_bars()
    if config.dataset_name:
        check_hub_repo(config.dataset_name, "dataset", flag="--dataset_name", instead="use --data_files")
        return datasets.load_dataset(config.dataset_name, config.dataset_config_name, split=split, streaming=True)
    if not config.data_files:
        raise no_data(config)
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
