"""Synchronised BatchNorm for CPU processes: the statistics of the whole global micro-batch, on any process count.

torch's `nn.SyncBatchNorm` runs on CUDA only, so a BatchNorm model on N CPU processes would normalise each process's
slice on its own and train differently from one process. `CPUSyncBatchNorm` all-reduces the per-channel sums with
autograd (the backward all-reduces the gradients): what `nn.SyncBatchNorm` computes with its CUDA kernels. Evaluation
uses the running statistics; the state dict is BatchNorm's, so a saved model loads into the plain model.
"""

import torch
import torch.distributed as dist
from torch import nn


def autograd_all_reduce():
    """A sum over the processes whose backward sums the gradients: torch's functional collective where torch has
    registered its autograd formula (2.13 has, and deprecates `torch.distributed.nn.functional.all_reduce` for it
    with a FutureWarning at every call), else that older function."""
    import torch.distributed._functional_collectives as functional  # registers the formula, where torch has one

    if torch._C._dispatch_has_kernel_for_dispatch_key("_c10d_functional::all_reduce", "Autograd"):
        return lambda tensor: functional.all_reduce(tensor, "sum", dist.group.WORLD)
    from torch.distributed.nn.functional import all_reduce

    return all_reduce


all_reduce = autograd_all_reduce()


class CPUSyncBatchNorm(nn.modules.batchnorm._BatchNorm):
    """BatchNorm1d/2d/3d whose training statistics are over every process's batch (see the module docstring)."""

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not (self.training and dist.is_initialized() and dist.get_world_size() > 1):
            return super().forward(x)
        dtype, x = x.dtype, x.float()  # statistics in float32, also under bf16 autocast
        dims = [0, *range(2, x.dim())]  # every dimension but the channels
        shape = [1, -1] + [1] * (x.dim() - 2)
        # two passes, as torch's own kernels: the mean first, then the squared deviations from it (no E[x^2] - E[x]^2)
        local = torch.cat([x.sum(dims), x.new_tensor([x.numel() / x.size(1)])])
        total = all_reduce(local)
        count, mean = total[-1], total[:-1] / total[-1]
        centered = x - mean.view(shape)
        var = all_reduce(centered.square().sum(dims)) / count  # biased, for normalising
        if self.track_running_stats:
            self.update_running_stats(mean.detach(), var.detach(), count.item())
        normalised = centered * torch.rsqrt(var + self.eps).view(shape)
        if self.affine:
            normalised = normalised * self.weight.view(shape) + self.bias.view(shape)
        return normalised.to(dtype)

    @torch.no_grad()
    def update_running_stats(self, mean: torch.Tensor, var: torch.Tensor, count: float) -> None:
        """As `_BatchNorm.forward`: momentum (or a cumulative average when it is None), the unbiased variance."""
        self.num_batches_tracked.add_(1)
        factor = 1.0 / self.num_batches_tracked.item() if self.momentum is None else self.momentum
        self.running_mean.lerp_(mean, factor)
        self.running_var.lerp_(var * count / max(count - 1, 1), factor)


def convert_cpu_sync_batchnorm(module: nn.Module) -> nn.Module:
    """Every BatchNorm layer of `module` -> CPUSyncBatchNorm with the same parameters and buffers (as
    `nn.SyncBatchNorm.convert_sync_batchnorm` does for CUDA)."""
    if isinstance(module, nn.modules.batchnorm._BatchNorm) and not isinstance(module, CPUSyncBatchNorm):
        converted = CPUSyncBatchNorm(
            module.num_features, module.eps, module.momentum, module.affine, module.track_running_stats
        )
        converted.load_state_dict(module.state_dict())
        for new, old in zip(converted.parameters(), module.parameters(), strict=True):
            new.requires_grad_(old.requires_grad)
        converted.train(module.training)
        return converted
    for name, child in module.named_children():
        module.add_module(name, convert_cpu_sync_batchnorm(child))
    return module
