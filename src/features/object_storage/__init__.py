"""`--output_mirror s3://bucket/run`: the run directory copied to object storage as it trains, and resumed from
there on a fresh machine (mirror.py; docs/object_storage.md)."""

import logging

from src.features import Feature
from src.features.object_storage.mirror import (
    MirrorOptions,
    check_mirror,
    fetch_checkpoint,
    prepare_mirror,
    upload_checkpoint,
    upload_run,
)
from src.run_dir import continues_its_run


class ObjectStorage(Feature):
    Options = MirrorOptions

    def check(self, config) -> None:  # unreachable, without credentials or holding another run: said before training
        for name in ("botocore", "aiobotocore"):  # "Found credentials in ...", at INFO, for each client
            logging.getLogger(name).setLevel(logging.WARNING)
        check_mirror(config)

    def before_resume(self, accelerator, config) -> None:  # the mirror's newest checkpoint, where the disk's is older
        fetch_checkpoint(accelerator, config)

    def on_start(self, accelerator, config, resumed: bool) -> None:  # a fresh start replaces the mirror's run too
        prepare_mirror(accelerator, config, resumed and continues_its_run(config))  # another folder's: a new run

    def on_checkpoint(self, accelerator, config, checkpoint, state) -> None:
        upload_checkpoint(accelerator, config, checkpoint, state)

    def on_end(self, accelerator, config, model_dir) -> None:  # model/, metrics.jsonl, eval_results.json
        upload_run(accelerator, config)


FEATURE = ObjectStorage()
