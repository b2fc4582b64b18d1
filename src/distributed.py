"""Build the Accelerator so one command trains alike on CPU, one GPU or N processes (docs/how_it_works.md). Without GPUs
a plain `Accelerator()` forms no group (N separate trainings, silently): `cpu=True` gives gloo DDP."""

import os

import torch
from accelerate import DataLoaderConfiguration, PartialState
from accelerate.utils import GradientAccumulationPlugin
from torch import nn

from src import features, strategy, tracking
from src.accelerator import Accelerator
from src.config import TrainConfig, resolve_global_batch
from src.errors import UsageError, let_threads_settle, one_line
from src.preemption import signals_as_default


def has_accelerator() -> bool:
    return torch.accelerator.is_available()


def build_accelerator(config: TrainConfig, log_with: list | None = None):
    features.installed().before_process_group()  # e.g. launcher_watch's: a rank never outlives its launcher
    use_cpu = not has_accelerator()
    if launcher_started_one_of_many():
        raise UsageError(
            "accelerate launch started this one process, not the --num_processes asked: without a multi-process "
            "accelerate config it runs the script once on a machine without GPUs; add --config_file "
            "accelerate_configs/ddp.yaml"
        )
    strategy.check_launch(use_cpu, config)
    accelerator_class = features.installed().accelerator_class(use_cpu) or Accelerator  # e.g. fast_accelerator's
    strategy_options = strategy.accelerator_options(use_cpu, config)  # cpu, and what FSDP/DeepSpeed need
    with signals_as_default():  # a process that failed before the group formed: the launcher's SIGTERM ends the wait
        state = PartialState(**strategy.process_group_options(strategy_options))  # forms the group
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if launched != state.num_processes:
        raise UsageError(
            f"the launcher started {launched} processes but they formed a group of {state.num_processes}; "
            "launch with `accelerate launch --config_file accelerate_configs/ddp.yaml` or `torchrun`"
        )
    data_parallel = strategy.data_parallel_size(state.num_processes)  # tensor-parallel ranks share their batches
    accumulation = resolve_global_batch(config, data_parallel) if config.do_train else 1
    if config.tf32 is not None and not use_cpu:
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = config.tf32
    try:
        accelerator = accelerator_class(
            log_with=log_with,
            mixed_precision=config.mixed_precision,  # None: the accelerate config's
            project_dir=config.output_dir,
            # sync_with_dataloader=False: no extra step at an epoch's end that another process count would not make
            gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=accumulation, sync_with_dataloader=False),
            # non_blocking: pinned copies overlap the step; dispatch_batches=False: each process slices a stream itself
            dataloader_config=DataLoaderConfiguration(
                use_seedable_sampler=True, non_blocking=not use_cpu, dispatch_batches=False
            ),
            device_placement=not use_cpu,  # on the CPU, placement would only re-check each batch
            **strategy_options,
        )
    except ValueError as err:  # e.g. fp16 without a GPU, or an accelerate config this machine can't run
        raise UsageError(f"Accelerate cannot run this setup: {one_line(err)}") from err
    if "fsdp_plugin" in strategy_options:  # FSDP on CPU processes: what Accelerate does for GPUs only
        strategy.enable_fsdp_on_cpu(accelerator, strategy_options["fsdp_plugin"])
    return accelerator


WORLD_SIZES = ("WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE")  # torchrun's, MPI's


def launcher_started_one_of_many() -> bool:
    """`accelerate launch --num_processes N>1`, no multi-process config, no GPU (or --cpu): one run, no world size."""
    env = os.environ
    return "ACCELERATE_USE_CPU" in env and "MASTER_PORT" in env and not any(name in env for name in WORLD_SIZES)


def summed_loss_scale(accelerator, task, window: list) -> torch.Tensor:
    """For a summed loss(): processes x accumulation / the global batch's terms (an exact integer all-reduce), so that
    after accumulation and DDP average, the gradient is the mean term's on any process count."""
    counted = torch.as_tensor(sum(task.count_items(batch) for batch in window), device=accelerator.device)
    items = accelerator.reduce(counted.long(), reduction="sum").float()
    return accelerator.num_processes * accelerator.gradient_accumulation_steps / items.clamp_min(1)


CHECKPOINTING = ("activation_checkpointing_enable", "gradient_checkpointing_enable")  # a model opts in: newest first


def enable_gradient_checkpointing(model: nn.Module) -> None:
    """A model opts in with either method: Transformers 5 warns that `gradient_checkpointing_enable` goes in 6."""
    enable = next((getattr(model, name) for name in CHECKPOINTING if hasattr(model, name)), None)
    if enable is None:
        raise UsageError(
            f"{type(model).__name__} does not support --gradient_checkpointing "
            "(it needs a gradient_checkpointing_enable method)"
        )
    enable()


def end_training(accelerator) -> None:
    accelerator.end_training()  # finishes the trackers
    tracking.started.clear()
    let_threads_settle(accelerator.num_processes)  # a moment for gloo's threads: see src/errors.py
