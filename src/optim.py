"""Optimiser and learning-rate schedule, in optimiser steps whatever the process count (early stopping: src/best.py)."""

import logging
import math
import weakref

import torch
from torch import nn

from src.config import TrainConfig

logger = logging.getLogger(__name__)

built: "weakref.WeakSet" = weakref.WeakSet()  # the optimisers and schedules made here: follow_config's to set


def build_optimizer(model: nn.Module, config: TrainConfig) -> torch.optim.Optimizer:
    """AdamW, no weight decay on 1-D parameters (biases, norms); fused as Trainer's default (`adamw_torch_fused`): one
    kernel, not a loop over parameters (~1.3 ms a step less on a tiny BERT, docs/benchmark.md), equal up to rounding."""
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.ndim < 2]
    groups = [{"params": decay, "weight_decay": config.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(
        groups, lr=config.learning_rate, betas=(config.adam_beta1, config.adam_beta2), fused=True
    )
    built.add(optimizer)
    return optimizer


def lr_factor(step: int, total_steps: int, warmup_steps: int, kind: str) -> float:
    """Multiplier on the base learning rate after `step` optimiser steps: linear warmup, then the decay `kind`."""
    if step < warmup_steps:
        return (step + 1) / (warmup_steps + 1)
    if kind in ("constant", "constant_with_warmup"):
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return 1.0 - progress if kind == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))  # else cosine


def build_scheduler(optimizer, config: TrainConfig, total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    warmup = 0 if config.lr_scheduler_type == "constant" else config.warmup_steps
    if warmup >= total_steps:  # a short run with the default 20 steps of warmup: its curve would look wrong
        logger.warning(
            "--warmup_steps %d covers all %d steps of this run: the learning rate only rises; lower --warmup_steps",
            *(warmup, total_steps),
        )
    elif 2 * warmup >= total_steps:  # most of a short run at a low rate: it barely learns
        logger.warning(
            "--warmup_steps %d is %d%% of this run's %d steps: the learning rate peaks late; lower --warmup_steps "
            "(a tenth of the run: %d)", *(warmup, 100 * warmup // total_steps, total_steps, total_steps // 10)
        )  # fmt: skip
    kind = config.lr_scheduler_type
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, total_steps, warmup, kind))
    built.add(scheduler)
    return scheduler


def follow_config(optimizer, scheduler: torch.optim.lr_scheduler.LambdaLR, config: TrainConfig) -> None:
    """After a resume: the config's learning rate, betas and weight decay, as its config.yaml says, not those the
    checkpoint's optimiser state brought back (a lower --learning_rate after a divergence did nothing); the schedule
    goes on from the checkpoint's step. Only an optimiser and schedule made here: yours resume as their checkpoint
    saved them."""
    inner = optimizer
    while inner is not None and inner not in built:
        inner = getattr(inner, "optimizer", None)  # inside Accelerate's wrapper (and DeepSpeed's ZeRO optimizer)
    if inner is None or scheduler not in built or len(optimizer.param_groups) != 2:
        return
    for group, decay in zip(optimizer.param_groups, (config.weight_decay, 0.0), strict=True):  # build_optimizer's
        group.update(initial_lr=config.learning_rate, betas=(config.adam_beta1, config.adam_beta2), weight_decay=decay)
    scheduler.base_lrs = [config.learning_rate] * len(optimizer.param_groups)
    scheduler.last_epoch -= 1
    scheduler.step()  # the checkpoint's step again: its rate from the config's
