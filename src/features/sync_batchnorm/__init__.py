"""Synchronised BatchNorm on CPU processes (batchnorm.py): torch's `nn.SyncBatchNorm` is CUDA-only, so without this
feature a BatchNorm model on N CPU processes normalises each process's slice on its own (the core says so at start)
and trains differently from one process. With it, `--norm batch` on 2 x 32 trains as 1 x 64 (docs/how_it_works.md)."""

from torch import nn

from src.features import Feature


class SyncBatchNorm(Feature):
    def adapt_model(self, model, accelerator):
        """On N CPU processes, every BatchNorm layer -> CPUSyncBatchNorm (the core converts to nn.SyncBatchNorm on
        CUDA)."""
        if accelerator.num_processes == 1 or accelerator.device.type != "cpu":
            return model
        if not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules()):
            return model
        from src.features.sync_batchnorm.batchnorm import convert_cpu_sync_batchnorm

        return convert_cpu_sync_batchnorm(model)


FEATURE = SyncBatchNorm()
