"""BatchNorm statistics over the global micro-batch on N processes: torch's `nn.SyncBatchNorm` on CUDA, and on CPU
processes, where torch has none, this feature's (batchnorm.py). With it, `--norm batch` on 2 x 32 trains as 1 x 64
(docs/how_it_works.md); without it, each process normalises its own slice, as in plain DDP. It warns at start where
the statistics stay per process or per micro-batch."""

import logging

from torch import nn

from src.features import Feature

logger = logging.getLogger(__name__)


class SyncBatchNorm(Feature):
    def adapt_model(self, model, accelerator):
        """Every BatchNorm layer synchronised on N processes (the state dict stays BatchNorm's); warnings."""
        batchnorms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
        accumulation = accelerator.gradient_accumulation_steps
        if batchnorms and accumulation > 1:
            # 1 process x 64 and 2 x 32 (synchronised) agree, 1 x 32 accumulated twice does not (docs/how_it_works.md)
            logger.warning(
                f"the model has BatchNorm and each optimiser step accumulates {accumulation} micro-batches: its "
                "statistics are those of one micro-batch, so another process count or per-device batch trains "
                f"differently; use a per-device batch {accumulation} times as large (--global_batch_size / "
                f"{accelerator.num_processes} processes: no accumulation), or GroupNorm (digits: --norm group)"
            )
        if not batchnorms or accelerator.num_processes == 1:
            return model
        if accelerator.device.type == "cuda":
            return nn.SyncBatchNorm.convert_sync_batchnorm(model)
        if accelerator.device.type == "cpu":
            from src.features.sync_batchnorm.batchnorm import convert_cpu_sync_batchnorm

            return convert_cpu_sync_batchnorm(model)
        logger.warning(
            f"BatchNorm statistics are per process: no synchronised BatchNorm on {accelerator.device.type}, so this "
            f"{accelerator.num_processes}-process run normalises each process's batch separately (--norm group for "
            "identical results)"
        )
        return model


FEATURE = SyncBatchNorm()
