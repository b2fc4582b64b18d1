"""The Accelerator with the loop's per-step calls as cheap as plain torch's where Accelerate's wrappers have nothing to
do (one process or DDP, no grad scaler), libraries a run doesn't use left unimported, and on the CPU freed host memory
kept for the next step (docs/benchmark.md). Without it the core builds src/accelerator.py's: the same training."""

import contextlib
import ctypes
import math
import os
import platform
from collections.abc import Iterable

import accelerate
import torch
from accelerate.optimizer import AcceleratedOptimizer

from src.accelerator import Accelerator
from src.features import Feature
from src.imports import hidden

PLAIN_TYPES = ("NO", "MULTI_CPU", "MULTI_GPU", "MULTI_XPU")  # no sharding engine or XLA graph for the wrappers to serve


class FastAccelerator(Accelerator):
    @property
    def plain(self) -> bool:
        """One process or DDP, no grad scaler: no wrappers. Read per call: FSDP on CPU comes later (src/strategy.py)."""
        return self.distributed_type.value in PLAIN_TYPES and self.scaler is None and not self.has_lomo_optimizer

    def accumulate(self, *models):
        """Without accumulation every micro-batch ends a step and gradients always sync: no context needed."""
        if self.gradient_state.num_steps > 1:
            return super().accumulate(*models)
        self.sync_gradients = True  # as upstream's sets it: a window an earlier run in this process left open ends
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor, **kwargs) -> None:
        if kwargs or not self.plain:
            return super().backward(loss, **kwargs)
        steps = self.gradient_state.num_steps
        (loss / steps if steps > 1 else loss).backward()

    def clip_grad_norm_(self, parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2):
        """The norm as a tensor, None where DeepSpeed has none; `max_norm=math.inf` skips scaling each gradient by 1."""
        if not self.plain:
            norm = super().clip_grad_norm_(parameters, max_norm, norm_type)
            return None if norm is None else torch.as_tensor(norm)  # DeepSpeed gives a float
        if max_norm == math.inf:
            return torch.nn.utils.get_total_norm([p.grad for p in parameters if p.grad is not None], norm_type)
        return torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type)

    def prepare(self, *args, device_placement=None):
        """Upstream's, minus importing deepspeed unless the run is DeepSpeed (FSDP2 + transformers: ~5 CPU-s)."""
        with deepspeed_only_if_used(self):
            return super().prepare(*args, device_placement=device_placement)

    def unwrap_model(self, model, keep_fp32_wrapper: bool = True, keep_torch_compile: bool = True):
        """Upstream's, minus importing deepspeed to seek an engine unless the run is DeepSpeed (~1-2 s, a warning): also
        inside `save_model` and `get_state_dict`, which call it, so the model save goes without it."""
        with deepspeed_only_if_used(self):
            return super().unwrap_model(model, keep_fp32_wrapper, keep_torch_compile)

    def prepare_data_loader(self, data_loader, device_placement=None, slice_fn_for_dispatch=None):
        """Upstream's, minus importing `datasets` (~0.5 s) to test for its IterableDataset, absent if never imported."""
        with hidden("datasets"):
            return super().prepare_data_loader(data_loader, device_placement, slice_fn_for_dispatch)

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer, device_placement=None):
        prepared = super().prepare_optimizer(optimizer, device_placement=device_placement)
        if self.plain and type(prepared) is AcceleratedOptimizer:
            prepared.__class__ = PlainOptimizer  # the same object (registered for checkpoints), lighter per step
        return prepared


def deepspeed_only_if_used(accelerator: accelerate.Accelerator):
    """Hide deepspeed unless the run is DeepSpeed: Accelerate's prepare and unwrap_model import it to seek an engine."""
    if accelerator.distributed_type == accelerate.utils.DistributedType.DEEPSPEED:
        return contextlib.nullcontext()
    return hidden("deepspeed")


class PlainOptimizer(AcceleratedOptimizer):
    """`AcceleratedOptimizer` in a plain run: no grad scaler, XLA or LOMO optimizer to consult at each step."""

    def step(self, closure=None):
        if self.gradient_state.sync_gradients:
            self.optimizer.step(closure)

    def zero_grad(self, set_to_none: bool = True):
        if self.gradient_state.sync_gradients:
            self.optimizer.zero_grad(set_to_none=set_to_none)


def keep_freed_host_memory() -> None:
    """Keep glibc from returning freed activations to the OS only to page-fault them back in (docs/benchmark.md)."""
    if platform.libc_ver()[0] != "glibc" or "glibc.malloc" in os.environ.get("GLIBC_TUNABLES", ""):
        return
    mallopt = ctypes.CDLL(None).mallopt  # the C library this process runs on
    mallopt(-3, 32 << 20)  # M_MMAP_THRESHOLD: blocks under 32 MB from the heap (glibc's maximum; its default moves)
    mallopt(-1, 1 << 30)  # M_TRIM_THRESHOLD: up to 1 GB free at the heap's top kept


class Fast(Feature):
    def accelerator_class(self, use_cpu: bool) -> type:
        if use_cpu:  # before the model and data exist: the heap's settings hold from the first allocation on
            keep_freed_host_memory()
        return FastAccelerator


FEATURE = Fast()
