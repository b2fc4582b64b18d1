"""`--auto_find_batch_size true`: after running out of memory, train again from the start with the largest per-device
batch at most half as large that keeps the global batch (the accumulation rises to match), as Trainer's option does
but without changing what the optimiser sees."""

import logging
from dataclasses import dataclass, replace

from src.errors import UsageError
from src.features import Feature

logger = logging.getLogger(__name__)


@dataclass
class AutoBatchSizeOptions:
    auto_find_batch_size: bool = False  # on out-of-memory: at most half the per-device batch, keep global_batch_size


class AutoBatchSize(Feature):
    Options = AutoBatchSizeOptions

    def check(self, config) -> None:
        if self.options(config).auto_find_batch_size and config.global_batch_size is None:
            raise UsageError(
                "--auto_find_batch_size needs --global_batch_size, so the optimiser's batch stays the same"
            )

    def wrap_train(self, train):
        def train_with_batch_size(config) -> dict:
            """train(config), or the largest per-device batch that fits, halving it after running out of memory."""
            if not self.options(config).auto_find_batch_size:
                return train(config)
            from accelerate.utils import find_executable_batch_size

            first = per_device = config.per_device_train_batch_size

            def smaller() -> int:  # at most half, the optimiser's batch the same: the accumulation rises
                nonlocal per_device
                per_device = smaller_device_batch(config, per_device)
                return per_device

            @find_executable_batch_size(starting_batch_size=first, reduce_batch_size_fn=smaller)
            def train_with(batch_size: int) -> dict:
                overwrite = config.overwrite_output_dir or batch_size != first  # a retry replaces a failed try's files
                return train(replace(config, per_device_train_batch_size=batch_size, overwrite_output_dir=overwrite))

            return train_with()

        return train_with_batch_size


def smaller_device_batch(config, per_device: int) -> int:
    """After running out of memory with `per_device` samples: the largest batch at most half as large that keeps the
    global batch (a whole accumulation count); UsageError once even 1 sample did not fit."""
    from accelerate import PartialState

    from src.strategy import data_parallel_size

    processes = data_parallel_size(PartialState().num_processes)  # the group the failed attempt formed
    fits = [size for size in range(per_device // 2, 0, -1) if config.global_batch_size % (size * processes) == 0]
    if not fits:
        raise UsageError(
            f"out of memory with a per-device batch of {per_device}, the smallest that keeps --global_batch_size "
            f"{config.global_batch_size}; use --gradient_checkpointing true, --mixed_precision bf16, more processes "
            "or a smaller model"
        )
    logger.warning("out of memory with a per-device batch of %d: retrying with %d", per_device, fits[0])
    return fits[0]


FEATURE = AutoBatchSize()
