"""The Accelerator a run builds: Accelerate's, minus DDP around a model with nothing to train on CPU processes. Features
may build a subclass instead (`Feature.accelerator_class`: fast_accelerator's per-step calls)."""

import accelerate
import torch


class Accelerator(accelerate.Accelerator):
    def prepare_model(self, model: torch.nn.Module, device_placement=None, evaluation_mode: bool = False):
        """Upstream's, minus DDP around a model with nothing to train on CPU processes (eval-only of an adapter): DDP
        refuses one, and upstream leaves it out on GPUs already."""
        frozen = not any(parameter.requires_grad for parameter in model.parameters())
        evaluation_mode |= frozen and self.distributed_type == accelerate.utils.DistributedType.MULTI_CPU
        return super().prepare_model(model, device_placement=device_placement, evaluation_mode=evaluation_mode)
