"""Accelerate's `Accelerator`, its per-step calls as cheap as plain torch's: in a plain run (one process or DDP, no fp16
grad scaler) they skip upstream's checks that have nothing to do and cost about a tiny model's whole step
(docs/benchmark.md); otherwise every call is Accelerate's own. tests/test_accelerator.py checks they give the same."""

import contextlib
import ctypes
import math
import os
import platform
from collections.abc import Iterable

import accelerate
import torch
from accelerate.optimizer import AcceleratedOptimizer

from src.imports import hidden

PLAIN_TYPES = ("NO", "MULTI_CPU", "MULTI_GPU", "MULTI_XPU")  # no sharding engine or XLA graph for the wrappers to serve


class Accelerator(accelerate.Accelerator):
    @property
    def plain(self) -> bool:
        """One process or DDP without a grad scaler: backward, clipping and the optimizer need no wrapper. Read at
        each call: FSDP on CPU processes is switched on after the Accelerator is built (src/strategy.py)."""
        return self.distributed_type.value in PLAIN_TYPES and self.scaler is None and not self.has_lomo_optimizer

    def accumulate(self, *models):
        """Without accumulation every micro-batch ends a step and gradients always sync: no context needed."""
        if self.gradient_state.num_steps == 1:
            return contextlib.nullcontext()
        return super().accumulate(*models)

    def backward(self, loss: torch.Tensor, **kwargs) -> None:
        """Upstream's: the loss divided by the accumulation steps (not by 1), then `loss.backward()`."""
        if kwargs or not self.plain:
            return super().backward(loss, **kwargs)
        steps = self.gradient_state.num_steps
        (loss / steps if steps > 1 else loss).backward()

    def clip_grad_norm_(self, parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2):
        """The total norm of the all-reduced gradients as a tensor, or None where DeepSpeed has none; gradients clipped
        to `max_norm`. `max_norm=math.inf` measures without clipping: no multiplication of every gradient by 1."""
        if not self.plain:
            norm = super().clip_grad_norm_(parameters, max_norm, norm_type)
            return None if norm is None else torch.as_tensor(norm)  # DeepSpeed gives a float
        if max_norm == math.inf:
            return torch.nn.utils.get_total_norm([p.grad for p in parameters if p.grad is not None], norm_type)
        return torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type)

    def prepare(self, *args, device_placement=None):
        """Upstream's. On FSDP2 it imports deepspeed wherever installed (transformers with it: ~5 CPU-s a process of
        4 on 2 cores) only to find the model is no DeepSpeedEngine: not unless the run is DeepSpeed."""
        with deepspeed_only_if_used(self):
            return super().prepare(*args, device_placement=device_placement)

    def prepare_data_loader(self, data_loader, device_placement=None, slice_fn_for_dispatch=None):
        """Upstream's. On N processes it imports `datasets` (~50 MB, ~0.5 s) only to ask whether the loader holds a
        datasets IterableDataset, which it can't where datasets was never imported: it stays unimported then."""
        with hidden("datasets"):
            return super().prepare_data_loader(data_loader, device_placement, slice_fn_for_dispatch)

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer, device_placement=None):
        prepared = super().prepare_optimizer(optimizer, device_placement=device_placement)
        if self.plain and type(prepared) is AcceleratedOptimizer:
            prepared.__class__ = PlainOptimizer  # the same object (registered for checkpoints), lighter per step
        return prepared


def deepspeed_only_if_used(accelerator: accelerate.Accelerator):
    """A context in which deepspeed looks uninstalled unless the run is DeepSpeed: Accelerate's `prepare` (FSDP2) and
    `unwrap_model` import it wherever it is installed, just to test for a DeepSpeedEngine."""
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
    """On the CPU, keep glibc's malloc from returning each step's freed activations to the OS only to page-fault them
    in again at the next step (docs/benchmark.md). Not when GLIBC_TUNABLES sets malloc options: yours win."""
    if platform.libc_ver()[0] != "glibc" or "glibc.malloc" in os.environ.get("GLIBC_TUNABLES", ""):
        return
    mallopt = ctypes.CDLL(None).mallopt  # the C library this process runs on
    mallopt(-3, 32 << 20)  # M_MMAP_THRESHOLD: blocks under 32 MB from the heap (glibc's maximum; its default moves)
    mallopt(-1, 1 << 30)  # M_TRIM_THRESHOLD: up to 1 GB free at the heap's top kept
