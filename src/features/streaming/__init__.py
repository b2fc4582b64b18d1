"""`--streaming true`: the train split read as a stream, for data bigger than memory or disk, with exact resume
(stream.py; docs/streaming.md). A task streams through its `build_train_stream()`."""

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from src.errors import UsageError
from src.features import Feature


@runtime_checkable
class StreamingTask(Protocol):
    def build_train_stream(self):
        """The train split as an IterableDataset of samples like build_datasets()' train items, with `set_epoch(epoch)`;
        e.g. `SampleStream(load_stream(self.config, split).map(...).shuffle(seed, buffer))` (stream.py). Its memory must
        not grow with the data: nothing is read before iteration."""


@dataclass
class StreamingOptions:
    streaming: bool = False  # read the train split as a stream (glob data_files; memory bounded); needs --max_steps
    shuffle_buffer_size: int = 10000  # --streaming: samples held to shuffle the stream (with the seed and epoch)

    def __post_init__(self):
        if self.shuffle_buffer_size <= 0:
            raise UsageError(f"--shuffle_buffer_size must be > 0 (got {self.shuffle_buffer_size})")


class Streaming(Feature):
    Options = StreamingOptions

    def check(self, config) -> None:
        if self.options(config).streaming and config.max_steps < 0:
            raise UsageError("--streaming needs --max_steps: a stream has no length to count epochs by")

    def train_loader(self, task, config, pin_memory: bool):
        """The train loader over the task's stream; full batches only (a stream has no length to pad to)."""
        if not self.options(config).streaming:
            return None
        from torch.utils.data import DataLoader

        if config.max_train_samples:
            raise UsageError("--max_train_samples does not apply with --streaming; --max_steps sets how much is read")
        if not isinstance(task, StreamingTask):
            raise UsageError(
                f"--task {type(task).__name__} cannot stream its data: it has no build_train_stream(); "
                "use --streaming false, or implement it (src/features/gpt/causal_lm.py has an example)"
            )
        return DataLoader(
            task.build_train_stream(),
            batch_size=config.per_device_train_batch_size,
            drop_last=True,
            num_workers=config.dataloader_num_workers,
            collate_fn=task.collate_fn(),
            pin_memory=pin_memory,
        )


FEATURE = Streaming()
